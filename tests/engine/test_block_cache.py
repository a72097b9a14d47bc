"""The block cache in the runner and the engine: opt-in per request, exact for everyone else,
counted in /metrics."""

import asyncio
import dataclasses
import time

import pytest
import torch

from gouache.block_cache.blocks import CachedForward
from gouache.block_cache.store import BlockCache
from gouache.config import BlockCacheConfig, SchedulerConfig
from gouache.engine.core import EngineCore
from gouache.executor.pool import DevicePool
from gouache.metrics import Metrics
from gouache.runner.model_runner import ModelRunner
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler
from tests.engine.test_exactness import request


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "tiny-sdxl"])
def test_whole_image_reuse_keeps_the_unchanged_image_and_computes_the_other(pipes, name):
    runner = ModelRunner(pipes(name))
    family, cache = runner.family, BlockCache()
    states = [runner.prepare(dataclasses.replace(request(rid, seed, 2), block_cache=0.05)) for rid, seed in
              (("a", 1), ("b", 2))]
    states = [runner.states[s.request_id] for s in states]
    first = family.predict(states, blocks=CachedForward.of(states, cache))
    states[1].latents = states[1].latents + torch.randn(states[1].latents.shape,
                                                        generator=torch.Generator().manual_seed(9))
    again = family.predict(states, blocks=CachedForward.of(states, cache))
    exact = family.predict(states)
    assert cache.reused > 0 and torch.equal(again[0], first[0])
    assert (again[1] - exact[1]).abs().max() <= 1e-5


def run(pipe, requests, policy="patched", config=None) -> tuple[dict[str, torch.Tensor], Metrics]:
    """Every request from step 0 to its end; final latents by id, and the engine's metrics."""
    runner, metrics = ModelRunner(pipe, patch_pixels=32, block_cache=config), Metrics()
    scheduler = Scheduler(make_policy(SchedulerConfig(policy=policy)))
    results = {}

    def keep(report):
        for state in report.finished:
            results[state.request_id] = runner.states.pop(state.request_id).latents

    core = EngineCore(DevicePool.in_process(runner), scheduler, metrics, keep,
                      lambda reasons, invalid: pytest.fail(str(reasons)), pytest.fail,
                      lambda error: pytest.fail(str(error)))
    for r in requests:
        scheduler.add(runner.prepare(r))
    while scheduler.has_work():
        core.step()
    return results, metrics


@pytest.mark.parametrize(("name", "policy"), [("tiny-sd", "patched"), ("tiny-sd", "orca"), ("tiny-sd3", "orca"),
                                             ("tiny-sd3", "patched"), ("tiny-flux", "patched")])
def test_an_exact_request_is_unchanged_by_cached_batch_mates_and_the_reuse_is_counted(pipes, name, policy):
    pipe = pipes(name)
    exact = request("exact", seed=7, steps=6)
    cached = [dataclasses.replace(request(f"cached-{i}", seed=i, steps=6, width=w), block_cache=0.5)
              for i, w in enumerate((64, 96))]
    alone, _ = run(pipe, [exact], policy)
    together, metrics = run(pipe, [exact, *cached], policy)
    assert (together["exact"] - alone["exact"]).abs().max() <= 1e-4
    counts = {s.labels["result"]: s.value for m in metrics.registry.collect() if m.name == "gouache_block_cache_blocks"
              for s in m.samples if s.name.endswith("_total")}
    assert counts["reused"] > 0 and counts["computed"] > 0
    assert all(torch.isfinite(x).all() for x in together.values())


def test_a_server_whose_every_step_is_sequence_parallel_refuses_block_cache_before_starting_workers():
    from gouache.config import BlockCacheConfig, EngineConfig, ModelConfig
    from gouache.engine.build import build_engine

    config = EngineConfig(executor="multiproc", devices=2, block_cache=BlockCacheConfig(0.1))
    with pytest.raises(ValueError, match="--block-cache would be ignored: every step of --policy fixed-sp-2"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="fixed-sp-2"))


def test_the_block_cache_frees_and_reports_what_finished_requests_held_once_idle(pipes):
    from gouache.config import EngineConfig
    from gouache.engine.client import AsyncEngine
    from gouache.runner.describe import model_info
    from tests.engine.test_async_engine import images
    from tests.engine.test_async_engine import run as run_async

    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(), make_policy(SchedulerConfig(policy="orca")))
    held, inner = [], engine.core.on_step
    engine.core.on_step = lambda report: (held.append(report.output.block_cache.held_bytes), inner(report))

    def gauge() -> float:
        return next(s.value for m in engine.metrics.registry.collect() if m.name == "gouache_block_cache_bytes"
                    for s in m.samples)

    async def scenario():
        await engine.start()
        await (await engine.submit(images("cached", steps=4, block_cache=0.5))).images()
        deadline = time.monotonic() + 10
        while gauge() > 0 and time.monotonic() < deadline:  # the engine settles within its idle wake-up
            await asyncio.sleep(0.05)
        value = gauge()
        await engine.aclose()
        return value

    assert run_async(scenario()) == 0 and max(held) > 0  # it kept the last step's bytes before
    assert engine.runner.cache.nbytes == 0


def reuse_everywhere(pipe, path) -> str:
    """A predictor file of `pipe`'s model whose forest says every unit may reuse."""
    from gouache.models.digest import model_digest
    from tests.block_cache.test_predictor import split_on_change

    split_on_change(1e30, model=model_digest(pipe)).save(path)
    return str(path)


@pytest.mark.parametrize(("name", "policy"), [("tiny-sd", "patched"), ("tiny-sd3", "orca"), ("tiny-sd3", "patched")])
def test_an_exact_request_is_unchanged_beside_predictor_driven_ones(pipes, name, policy, tmp_path):
    pipe = pipes(name)
    config = BlockCacheConfig(predictor=reuse_everywhere(pipe, tmp_path / "reuse.json"))
    exact = request("exact", seed=7, steps=6)
    cached = [dataclasses.replace(request(f"cached-{i}", seed=i, steps=6, width=w), block_cache=0.5)
              for i, w in enumerate((64, 96))]
    alone, _ = run(pipe, [exact], policy)
    together, metrics = run(pipe, [exact, *cached], policy, config)
    assert (together["exact"] - alone["exact"]).abs().max() <= 1e-4
    counts = {s.labels["result"]: s.value for m in metrics.registry.collect() if m.name == "gouache_block_cache_blocks"
              for s in m.samples if s.name.endswith("_total")}
    decide = [s.value for m in metrics.registry.collect() if m.name == "gouache_block_cache_decide_seconds"
              for s in m.samples if s.name.endswith("_total")]
    assert counts["reused"] > 0 and decide[0] > 0


def test_a_predictor_of_another_model_or_not_a_predictor_is_refused_with_the_reason(tmp_path, pipes):
    import json

    reuse_everywhere(pipes("tiny-sdxl"), tmp_path / "other.json")
    (tmp_path / "cost.json").write_text(json.dumps({"kind": "mask"}))
    (tmp_path / "broken.json").write_text("{")
    truncated = json.loads((tmp_path / "other.json").read_text())
    del truncated["left"]
    (tmp_path / "truncated.json").write_text(json.dumps(truncated))
    for name, reason in (("other.json", "trained on another model"), ("cost.json", "not a reuse predictor"),
                         ("broken.json", "cannot read it"), ("missing.json", "cannot read it")):
        with pytest.raises(ValueError, match=reason):
            ModelRunner(pipes("tiny-sd"), block_cache=BlockCacheConfig(predictor=str(tmp_path / name)))
    with pytest.raises(ValueError, match="malformed"):
        ModelRunner(pipes("tiny-sdxl"), block_cache=BlockCacheConfig(predictor=str(tmp_path / "truncated.json")))


def test_a_forest_that_splits_on_the_change_at_the_threshold_decides_as_the_threshold_does(pipes, tmp_path):
    from gouache.models.digest import model_digest
    from tests.block_cache.test_predictor import split_on_change

    pipe = pipes("tiny-sd")
    split_on_change(0.3, model=model_digest(pipe)).save(tmp_path / "split.json")
    requests = [request(f"cached-{i}", seed=i, steps=8, width=w) for i, w in enumerate((64, 96))]
    by_threshold, counted = run(pipe, [dataclasses.replace(r, block_cache=0.3) for r in requests], "patched",
                                BlockCacheConfig(threshold=0.3))
    # P(reusable) is 1 where the change is <= 0.3, else 0: above the cut-off 1 - 0.5 exactly there
    # (the tiny model's units are under the features' sample size: their change is the threshold's)
    by_forest, _ = run(pipe, [dataclasses.replace(r, block_cache=0.5) for r in requests], "patched",
                       BlockCacheConfig(predictor=str(tmp_path / "split.json")))
    reused = [s.value for m in counted.registry.collect() if m.name == "gouache_block_cache_blocks"
              for s in m.samples if s.labels.get("result") == "reused" and s.name.endswith("_total")]
    assert reused[0] > 0
    for rid in by_threshold:
        assert torch.equal(by_forest[rid], by_threshold[rid]), rid


def test_a_predictor_is_refused_where_every_step_is_sequence_parallel_and_a_wrong_one_before_workers(tmp_path):
    from gouache.config import EngineConfig, ModelConfig
    from gouache.engine.build import build_engine

    (tmp_path / "broken.json").write_text("{")
    config = EngineConfig(executor="multiproc", devices=2,
                          block_cache=BlockCacheConfig(predictor=str(tmp_path / "x.json")))
    with pytest.raises(ValueError, match="--block-cache-predictor would be ignored: every step of --policy fixed-sp-2"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="fixed-sp-2"))
    config = EngineConfig(executor="multiproc", devices=1,
                          block_cache=BlockCacheConfig(predictor=str(tmp_path / "broken.json")))
    with pytest.raises(ValueError, match="cannot read it"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="orca"))
