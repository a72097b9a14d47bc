"""Mask-aware edits of a template (InstGenIE §3): the first edit records, later ones compute
their masked tokens only. With the recorder's own request the template's activations are the
ones a full forward computes, so the replay is exact; any other request next to it is untouched."""

import numpy as np
import pytest

from gouache.config import TemplateConfig
from gouache.models.digest import model_digest
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload

TOL = 1e-4
STEPS = 3


@pytest.fixture(scope="module",
                params=["tiny-sd3", "tiny-flux", "tiny-flux-kontext", "tiny-sd", "tiny-sdxl", "tiny-sd-inpaint"])
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
        runner.prepare(request, Upload(image, EditMask(mask)))
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
    assert (counts.replayed_text > 0) == (not runner.family.patches)  # the same text: a DiT replays its text rows
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
    # text rows replay where the conditioning is the recorder's: CFG's unconditional row (its empty
    # negative prompt) of a DiT; not a prompt of its own, nor a UNet (cross-attention, no text rows)
    uncond_replays = not runner.family.patches and runner.states["other"].rows == 2
    assert (runner.templates.counts.replayed_text > 0) == uncond_replays


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
    # a Kontext edit's reference is half its forward's tokens, none of them repainted
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path), full_above=0.4))
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
    run(runner, [(edit("healed"), original, mask)])  # the lost steps were recorded again by the edit that missed them
    assert runner.templates.counts.replayed_tokens > 0 and runner.templates.counts.full_steps == STEPS


def test_the_live_load_plan_overlaps_loads_and_computes_the_rest_in_full(tmp_path):
    """Two blocks, per block: 1 s masked, 3 s in full, 2.5 s to load. Loading both ends at 6 s,
    computing both at 6 s; computing the first in full while the second loads ends at 4 s."""
    from types import SimpleNamespace

    from gouache.block_cache.blocks import cacheable_blocks
    from gouache.templates.replay import TemplateCache

    model = load_pipeline("tiny-sd3").transformer
    first, second, *rest = [key for _, _, key in cacheable_blocks(model)]
    assert not rest
    cache = TemplateCache(TemplateConfig(directory=str(tmp_path)), "cuda")  # makes no CUDA call by itself
    cache.cost = SimpleNamespace(compute_time=lambda batch: 2.0 * (3 if batch[0][1] == 1.0 else 1),
                                 load_time=lambda batch: 5.0, plain_time=lambda batch: 6.0)
    blocks = [first, second]
    assert cache.plan(blocks, 64, 0.2, 1, "host") == frozenset({first})
    assert cache.plan(blocks, 64, 0.2, 1, "device") == frozenset()  # on the device already: nothing to load
    cache.cost.plain_time = lambda batch: 4.0  # the plan's 4 s is no faster than regenerating: in full
    assert cache.plan(blocks, 64, 0.2, 1, "host") is None
    cpu = TemplateCache(TemplateConfig(directory=str(tmp_path / "cpu")), "cpu")
    cpu.cost = SimpleNamespace(**vars(cache.cost) | {"plain_time": lambda batch: None})
    assert cpu.plan(blocks, 64, 0.2, 1, "host") == frozenset()  # a CPU's memory is its device's


def test_blocks_the_plan_computes_in_full_take_every_token_and_stay_exact(pipe, tmp_path):
    original, mask = picture()
    runner = ModelRunner(pipe, templates=TemplateConfig(directory=str(tmp_path)))
    exact = run(runner, [(edit("exact", template=False), original, mask)])["exact"]
    run(runner, [(edit("first"), original, mask)])
    first_block, *others = runner.family.template_blocks()
    runner.templates.plan = lambda *args: frozenset({first_block})
    replayed = run(runner, [(edit("again"), original, mask)])["again"]
    assert runner.templates.counts.replayed_tokens > 0
    if not runner.family.patches:  # a DiT has one token grid (a UNet's levels have their own)
        state = runner.states["again"]
        kept = (~state.template.tokens).sum().item() * state.rows  # unmasked tokens, over the CFG rows
        assert runner.templates.counts.replayed_tokens == STEPS * len(others) * kept  # the first block computes all
    assert (replayed - exact).abs().max() <= TOL


@pytest.mark.slow
def test_the_model_digest_is_the_same_in_every_process_and_tells_models_apart():
    # a restart adopts its store's files only for the same model: the digest must not vary run
    # to run (diffusers' configs list their defaulted keys in set order)
    import os
    import subprocess
    import sys

    code = ("from gouache.models.zoo import load_pipeline; from gouache.models.digest import model_digest; "
            "print(model_digest(load_pipeline('tiny-sd')))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"  # another set order than this process's
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
    assert other == model_digest(load_pipeline("tiny-sd")) != model_digest(load_pipeline("tiny-sdxl"))
