"""Edits work with every family: blending for 4/16-channel denoisers, natively for 9-channel
UNets; the unmasked region comes back with the original pixels."""

import numpy as np
import pytest

from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd-inpaint", "tiny-sdxl-inpaint", "tiny-sd3", "tiny-flux"])
def test_edit_repaints_only_the_mask(pipes, name):
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
    mask = np.zeros((64, 96), np.float32)
    mask[16:48, 32:80] = 1.0
    runner = ModelRunner(pipes(name))
    request = ImageRequest("e", "a cat", 96, 64, 3, 4.0, seed=1, image=b"-")
    state = runner.prepare(request, original, mask)
    for _ in range(state.num_steps):
        runner.execute(Batch(("e",)))
    out = runner.decode("e")
    assert out.shape == original.shape
    assert np.array_equal(out[mask == 0], original[mask == 0])
    assert np.abs(out[mask == 1].astype(int) - original[mask == 1]).mean() > 5


INPAINT_PIPELINES = {"tiny-sd": "StableDiffusionInpaintPipeline", "tiny-sd-inpaint": "StableDiffusionInpaintPipeline",
                     "tiny-sdxl": "StableDiffusionXLInpaintPipeline",
                     "tiny-sdxl-inpaint": "StableDiffusionXLInpaintPipeline",
                     "tiny-sd3": "StableDiffusion3InpaintPipeline", "tiny-flux": "FluxInpaintPipeline"}


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
    runner.prepare(request, original, mask)
    for _ in range(3):
        runner.execute(Batch(("e",)))
    cls = getattr(diffusers, INPAINT_PIPELINES[name])
    inpaint = cls(**{k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]})
    inpaint.set_progress_bar_config(disable=True)
    expected = inpaint(
        "a cat", image=Image.fromarray(original), mask_image=Image.fromarray((mask * 255).astype(np.uint8)),
        height=64, width=96, num_inference_steps=3, guidance_scale=4.0, strength=1.0,
        generator=torch.Generator().manual_seed(1), output_type="latent",
    ).images
    assert expected.abs().mean() > 0.1
    assert (runner.states["e"].latents - expected).abs().max() <= 1e-4
