"""FLUX.2 [klein] (`gouache.runner.families.flux2`): an edit's uploads are its reference tokens.
An edit without a mask, of one image or several (the others at their own sizes), equals
Flux2KleinPipeline given the same images; a masked edit equals Flux2KleinInpaintPipeline (the
original its first reference, a second upload its `image_reference`); batched with generations
and each other under orca and patched."""

import numpy as np
import pytest
import torch
from PIL import Image

from gouache.request import ImageRequest
from gouache.uploads import EditMask, Upload
from tests.engine.conftest import as_state_latents
from tests.engine.test_exactness import run_engine

MODEL = "tiny-flux2-klein"


def uploads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"wide": rng.integers(0, 255, (64, 96, 3), dtype=np.uint8),
            "other": rng.integers(0, 255, (80, 64, 3), dtype=np.uint8)}


def klein_reference(pipe, request: ImageRequest, images: list[np.ndarray]) -> torch.Tensor:
    extra = {"image": [Image.fromarray(i) for i in images]} if images else {}
    return as_state_latents(pipe, pipe(
        prompt=request.prompt, height=request.height, width=request.width,
        num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
        generator=torch.Generator().manual_seed(request.seed), output_type="latent", **extra).images)


def inpaint_reference(pipe, request: ImageRequest, image: np.ndarray, mask: np.ndarray,
                      reference: np.ndarray | None) -> torch.Tensor:
    import diffusers

    cls = diffusers.Flux2KleinInpaintPipeline
    inpaint = cls(**{k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]})
    inpaint.set_progress_bar_config(disable=True)
    extra = {} if reference is None else {"image_reference": Image.fromarray(reference)}
    return as_state_latents(pipe, inpaint(
        prompt=request.prompt, image=Image.fromarray(image), mask_image=Image.fromarray((mask * 255).astype(np.uint8)),
        height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale, strength=1.0, generator=torch.Generator().manual_seed(request.seed),
        output_type="latent", **extra).images)


@pytest.mark.parametrize("policy", ["orca", "patched"])
def test_edits_of_one_and_two_images_equal_the_pipeline_in_a_mixed_batch(pipes, policy):
    pipe = pipes(MODEL)
    images = uploads()
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    one = ImageRequest("one", "make it blue", 96, 64, 3, 4.0, seed=1, image=b"-")
    two = ImageRequest("two", "put the second in the first", 96, 64, 3, 4.0, seed=2, image=b"-")
    generation = ImageRequest("generation", "make it blue", 96, 64, 3, 4.0, seed=1)
    masked = ImageRequest("masked", "a cat", 96, 64, 2, 4.0, seed=3, image=b"-")
    arrivals = {0: [(one, {"upload": Upload(images["wide"])}), generation],
                1: [(two, {"upload": Upload(images["wide"], references=(images["other"],))}),
                    (masked, {"upload": Upload(images["wide"], EditMask(mask))})]}
    latents = run_engine(pipe, arrivals, policy)
    expected = {"one": klein_reference(pipe, one, [images["wide"]]),
                "two": klein_reference(pipe, two, [images["wide"], images["other"]]),
                "generation": klein_reference(pipe, generation, []),
                "masked": inpaint_reference(pipe, masked, images["wide"], mask, None)}
    for rid, reference in expected.items():
        assert reference.abs().mean() > 0.1
        assert (latents[rid] - reference).abs().max() <= 1e-4, rid
    assert (latents["one"] - latents["generation"]).abs().max() > 1e-3  # the reference tokens count
    assert (latents["one"] - latents["two"]).abs().max() > 1e-3


def test_a_masked_edit_with_a_second_upload_takes_it_as_its_image_reference(pipes):
    pipe = pipes(MODEL)
    images = uploads()
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    masked = ImageRequest("masked", "a cat", 96, 64, 2, 4.0, seed=3, image=b"-")
    latents = run_engine(pipe, {0: [(masked, {"upload": Upload(images["wide"], EditMask(mask),
                                                               (images["other"],))})]})
    expected = inpaint_reference(pipe, masked, images["wide"], mask, images["other"])
    assert (latents["masked"] - expected).abs().max() <= 1e-4
