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
