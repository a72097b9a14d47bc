"""Mask-aware edits of a template (InstGenIE §3): the first edit records, later ones compute
their masked tokens only. With the recorder's own request the template's activations are the
ones a full forward computes, so the replay is exact; any other request next to it is untouched."""

import numpy as np
import pytest
import torch

from gouache.config import TemplateConfig
from gouache.request import ImageRequest
from gouache.runner.models import load_pipeline
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

TOL = 1e-4
STEPS = 3


@pytest.fixture(scope="module", params=["tiny-sd3", "tiny-flux"])
def pipe(request):
    return load_pipeline(request.param)


def picture(h=64, w=96):
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    mask = np.zeros((h, w), np.float32)
    mask[16:32, 32:64] = 1.0  # a sixth of the image (tokens: a bit more, where the box cuts a token)
    return original, mask


def edit(rid: str, template: bool = True, prompt: str = "a cat", seed: int = 1, size=(64, 96)) -> ImageRequest:
    h, w = size
    return ImageRequest(rid, prompt, w, h, STEPS, 4.0, seed=seed, image=b"-", template_cache=template)


def run(runner: ModelRunner, requests: list[tuple[ImageRequest, np.ndarray, np.ndarray]], patched=False):
    for request, image, mask in requests:
        runner.prepare(request, image, mask)
    ids = tuple(r.request_id for r, _, _ in requests)
    for _ in range(STEPS):
        out = runner.execute(Batch(ids, patched=patched))
        assert not out.failed
    return {rid: runner.states[rid].latents.clone() for rid in ids}


def test_a_replay_of_the_recorders_own_request_is_exact_and_computes_the_mask_only(pipe, tmp_path):
    original, mask = picture()
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path)))
    exact = run(runner, [(edit("exact", template=False), original, mask)])["exact"]
    recorded = run(runner, [(edit("first"), original, mask)])["first"]
    key = runner.states["first"].template.key
    assert runner.templates.counts.replayed_tokens == 0
    assert [runner.templates.store.tier_of(f"{key}/{k}") for k in range(STEPS + 1)] == ["host"] * STEPS + [None]
    replayed = run(runner, [(edit("again"), original, mask)])["again"]
    counts = runner.templates.counts
    assert (recorded - exact).abs().max() <= TOL  # the recorder ran in full
    assert (replayed - exact).abs().max() <= TOL
    tokens = runner.states["again"].template.tokens
    assert counts.computed_tokens and counts.replayed_tokens / counts.computed_tokens == pytest.approx(
        (~tokens).sum().item() / tokens.sum().item())
    assert counts.full_steps == 0


def test_an_edit_of_another_prompt_and_seed_takes_the_template_outside_its_mask(pipe, tmp_path):
    original, mask = picture()
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path)))
    run(runner, [(edit("first"), original, mask)])
    other = edit("other", prompt="a red circle", seed=7)
    replayed = run(runner, [(other, original, mask)])["other"]
    exact = run(runner, [(edit("exact", template=False, prompt="a red circle", seed=7), original, mask)])["exact"]
    difference = (replayed - exact).abs()
    assert 0 < difference.max() < 0.5 * exact.abs().max()  # an approximation, not garbage
    assert runner.templates.counts.replayed_tokens > 0


def test_replays_share_a_forward_with_other_sizes_and_plain_requests(pipe, tmp_path):
    original, mask = picture()
    small, small_mask = picture(64, 64)
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path)))
    run(runner, [(edit("first"), original, mask)])
    alone = run(runner, [(edit("plain", template=False, seed=3, size=(64, 64)), small, small_mask)])["plain"]
    ratio = run(runner, [(edit("replay"), original, mask)])["replay"]
    both = run(runner, [(edit("replay2"), original, mask),
                        (edit("plain2", template=False, seed=3, size=(64, 64)), small, small_mask)], patched=True)
    assert (both["plain2"] - alone).abs().max() <= TOL
    assert (both["replay2"] - ratio).abs().max() <= TOL


def test_a_near_full_mask_or_a_lost_entry_runs_in_full(pipe, tmp_path):
    original, mask = picture()
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path), full_above=0.5))
    run(runner, [(edit("first"), original, mask)])
    everything = np.ones_like(mask)
    exact = run(runner, [(edit("exact", template=False), original, everything)])["exact"]
    full = run(runner, [(edit("big"), original, everything)])["big"]
    assert runner.templates.counts.full_steps == STEPS and runner.templates.counts.replayed_tokens == 0
    assert (full - exact).abs().max() <= TOL
    for path in tmp_path.iterdir():  # the disk tier lost every step (memory holds none: budget 0 below)
        path.unlink()
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path), host_bytes=0))
    run(runner, [(edit("first"), original, mask)])
    for path in tmp_path.iterdir():
        path.write_bytes(b"not safetensors")
    exact = run(runner, [(edit("exact", template=False), original, mask)])["exact"]
    lost = run(runner, [(edit("lost"), original, mask)])["lost"]
    assert runner.templates.counts.full_steps == STEPS and runner.templates.store.corrupt == STEPS
    assert (lost - exact).abs().max() <= TOL
