"""Edits work with every family: blending for 4/16-channel denoisers, natively for 9-channel
UNets; the unmasked region comes back with the original pixels. Edits without a mask and with
a strength are img2img, equal to the family's Img2Img pipeline."""

import numpy as np
import pytest

from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload
from tests.engine.conftest import guidance_kwargs


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd-inpaint", "tiny-sdxl-inpaint", "tiny-sd3", "tiny-flux",
                                  "tiny-qwen-image", "tiny-zimage"])
def test_edit_repaints_only_the_mask(pipes, name):
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    runner = ModelRunner(pipes(name))
    request = ImageRequest("e", "a cat", 96, 64, 3, 4.0, seed=1, image=b"-")
    state = runner.prepare(request, Upload(original, EditMask(mask)))
    for _ in range(state.num_steps):
        runner.execute(Batch(("e",)))
    out = runner.decode("e")
    assert out.shape == original.shape
    assert np.array_equal(out[mask == 0], original[mask == 0])
    assert np.abs(out[mask == 1].astype(int) - original[mask == 1]).mean() > 5


INPAINT_PIPELINES = {"tiny-sd": "StableDiffusionInpaintPipeline", "tiny-sd-inpaint": "StableDiffusionInpaintPipeline",
                     "tiny-sdxl": "StableDiffusionXLInpaintPipeline",
                     "tiny-sdxl-inpaint": "StableDiffusionXLInpaintPipeline",
                     "tiny-sd3": "StableDiffusion3InpaintPipeline", "tiny-flux": "FluxInpaintPipeline",
                     "tiny-qwen-image": "QwenImageInpaintPipeline", "tiny-zimage": "ZImageInpaintPipeline"}


@pytest.mark.parametrize("name", INPAINT_PIPELINES)
def test_an_edit_equals_diffusers_inpaint_pipeline_seed_for_seed(pipes, name):
    """4/16-channel denoisers blend, 9-channel UNets take the mask; all draw from the request's
    generator in the pipeline's order (a 9-channel UNet at strength 1 encodes no original before
    the noise)."""
    import diffusers
    import torch
    from PIL import Image

    pipe = pipes(name)
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    runner = ModelRunner(pipe)
    request = ImageRequest("e", "a cat", 96, 64, 3, 4.0, seed=1, image=b"-")
    runner.prepare(request, Upload(original, EditMask(mask)))
    for _ in range(3):
        runner.execute(Batch(("e",)))
    cls = getattr(diffusers, INPAINT_PIPELINES[name])
    inpaint = cls(**{k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]})
    inpaint.set_progress_bar_config(disable=True)
    expected = inpaint(
        "a cat", image=Image.fromarray(original), mask_image=Image.fromarray((mask * 255).astype(np.uint8)),
        height=64, width=96, num_inference_steps=3, **guidance_kwargs(pipe, 4.0), strength=1.0,
        generator=torch.Generator().manual_seed(1), output_type="latent",
    ).images
    assert expected.abs().mean() > 0.1
    assert (runner.states["e"].latents - expected).abs().max() <= 1e-4


IMG2IMG_PIPELINES = {"tiny-sd": "StableDiffusionImg2ImgPipeline", "tiny-sdxl": "StableDiffusionXLImg2ImgPipeline",
                     "tiny-sd3": "StableDiffusion3Img2ImgPipeline", "tiny-flux": "FluxImg2ImgPipeline",
                     "tiny-qwen-image": "QwenImageImg2ImgPipeline", "tiny-zimage": "ZImageImg2ImgPipeline"}


def img2img_reference(pipe, cls_name: str, request: ImageRequest, original: np.ndarray):
    import diffusers
    import torch
    from PIL import Image

    cls = getattr(diffusers, cls_name)
    img2img = cls(**{k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]})
    img2img.set_progress_bar_config(disable=True)
    return img2img(
        request.prompt, image=Image.fromarray(original), height=request.height, width=request.width,
        num_inference_steps=request.num_inference_steps, **guidance_kwargs(pipe, request.guidance_scale),
        strength=request.strength, generator=torch.Generator().manual_seed(request.seed), output_type="latent",
    ).images


@pytest.mark.parametrize("policy", ["orca", "patched"])
@pytest.mark.parametrize("name", IMG2IMG_PIPELINES)
def test_img2img_equals_diffusers_img2img_pipeline_seed_for_seed_in_a_batch_of_other_strengths(pipes, name, policy):
    """Strengths 0.5, 0.8 and 1 run 2, 3 (UNets) or 4 (flow models: their pipelines round the
    other way) and 4 of 4 steps, batched with each other, a generation and a masked edit."""
    from tests.engine.test_exactness import run_engine

    pipe = pipes(name)
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    img2img = [ImageRequest(f"s{strength}", "a cat", 96, 64, 4, 4.0, seed=1, image=b"-", strength=strength)
               for strength in (0.5, 0.8, 1.0)]
    arrivals = {0: [(img2img[0], {"upload": Upload(original)}),
                    ImageRequest("generation", "a dog", 64, 64, 3, 4.0, seed=2)],
                1: [(img2img[1], {"upload": Upload(original)}), (img2img[2], {"upload": Upload(original)}),
                    (ImageRequest("masked", "a cat", 96, 64, 3, 4.0, seed=3, image=b"-"),
                     {"upload": Upload(original, EditMask(mask))})]}
    latents = run_engine(pipe, arrivals, policy)
    steps = {r.request_id: len(ModelRunner(pipe).family.prepare(r, Upload(original)).timesteps) for r in img2img}
    assert steps == ({"s0.5": 2, "s0.8": 3, "s1.0": 4} if name in ("tiny-sd", "tiny-sdxl")
                     else {"s0.5": 2, "s0.8": 4, "s1.0": 4})
    for request in img2img:
        expected = img2img_reference(pipe, IMG2IMG_PIPELINES[name], request, original)
        assert expected.abs().mean() > 0.1
        assert (latents[request.request_id] - expected).abs().max() <= 1e-4, request.request_id


def test_sdxl_img2img_normalises_by_the_vaes_latent_statistics_as_its_pipeline_does():
    """SDXL's Img2Img pipeline encodes with the VAE's latents_mean / latents_std where its config
    has them (its inpaint pipeline does not; the decode always does)."""
    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline("tiny-sdxl")
    pipe.set_progress_bar_config(disable=True)
    channels = pipe.vae.config.latent_channels
    pipe.vae.register_to_config(latents_mean=[0.1 * c for c in range(channels)],
                                latents_std=[0.5 + 0.25 * c for c in range(channels)])
    original = np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    request = ImageRequest("e", "a cat", 64, 64, 4, 4.0, seed=5, image=b"-", strength=0.5)
    runner = ModelRunner(pipe)
    state = runner.prepare(request, Upload(original))
    plain = ModelRunner(load_pipeline("tiny-sdxl"))
    plain.prepare(request, Upload(original))
    assert (plain.states["e"].latents - runner.states["e"].latents).abs().max() > 0.1  # the statistics matter
    for _ in range(state.num_steps):
        runner.execute(Batch(("e",)))
    expected = img2img_reference(pipe, IMG2IMG_PIPELINES["tiny-sdxl"], request, original)
    assert (runner.states["e"].latents - expected).abs().max() <= 1e-4
