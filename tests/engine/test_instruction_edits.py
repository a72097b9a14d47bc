"""Instruction edits (FLUX.1 Kontext): an edit without a mask follows its prompt, the upload's
latents as reference tokens, equal to diffusers' FluxKontextPipeline seed for seed (its image
kept at the request's size: `_auto_resize=False`, `max_area` = the size), alone and batched
with generations, edits of another size and masked edits, under orca and patched."""

import numpy as np
import pytest
import torch
from PIL import Image

from gouache.request import ImageRequest
from tests.engine.test_exactness import run_engine

MODEL = "tiny-flux-kontext"


def kontext_reference(pipe, request: ImageRequest, image: np.ndarray | None) -> torch.Tensor:
    extra = {} if image is None else {"image": Image.fromarray(image), "_auto_resize": False}
    return pipe(prompt=request.prompt, height=request.height, width=request.width,
                num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
                generator=torch.Generator().manual_seed(request.seed), output_type="latent",
                max_area=request.height * request.width, **extra).images


@pytest.mark.parametrize("policy", ["orca", "patched"])
def test_an_instruction_edit_equals_diffusers_kontext_pipeline_in_a_mixed_batch(pipes, policy):
    pipe = pipes(MODEL)
    rng = np.random.default_rng(0)
    wide, square = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8), rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    edit = ImageRequest("edit", "make it blue", 96, 64, 3, 2.5, seed=1, image=b"-")
    same_size = ImageRequest("generation", "make it blue", 96, 64, 3, 2.5, seed=1)
    other_size = ImageRequest("square", "a cat", 64, 64, 2, 2.5, seed=2, image=b"-")
    masked = ImageRequest("masked", "a cat", 96, 64, 3, 2.5, seed=3, image=b"-")
    arrivals = {0: [(edit, {"image": wide}), same_size],
                1: [(other_size, {"image": square}), (masked, {"image": wide, "mask": mask})]}
    latents = run_engine(pipe, arrivals, policy)
    expected = {"edit": kontext_reference(pipe, edit, wide), "generation": kontext_reference(pipe, same_size, None),
                "square": kontext_reference(pipe, other_size, square)}
    for rid, reference in expected.items():
        assert (latents[rid] - reference).abs().max() <= 1e-4, rid
    assert (latents["edit"] - latents["generation"]).abs().max() > 1e-3  # the reference tokens count
    assert torch.isfinite(latents["masked"]).all()
