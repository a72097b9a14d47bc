"""The conditioning cache: a repeated prompt skips the text encoders and a repeated upload the
VAE encoder, with the same results bit for bit; the cache keeps to its byte budget, least
recently used out first; the engine counts its lookups in /metrics."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from gouache.config import EngineConfig, SchedulerConfig
from gouache.engine.client import AsyncEngine
from gouache.request import ImageRequest
from gouache.runner.conditioning import ConditioningCache
from gouache.runner.describe import model_info
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.sched.policies import make_policy
from gouache.uploads import EditMask, Upload
from tests.engine.test_async_engine import images, run
from tests.engine.test_templates import samples


def test_the_cache_keeps_to_its_budget_least_recently_used_out_first():
    cache = ConditioningCache(budget_bytes=3 * 400)
    calls = []

    def encode(name):
        return lambda: calls.append(name) or (torch.zeros(100), name)  # 400 bytes each

    for name in ("a", "b", "c", "a", "d", "b"):  # "a" is used again before "d" evicts "b"
        assert cache.text(name, encode(name))[1] == name
    assert calls == ["a", "b", "c", "d", "b"] and cache.nbytes == 1200
    assert cache.take_report().lookups == {("text", "miss"): 5, ("text", "hit"): 1}
    assert cache.take_report().lookups == {}  # counts are taken once
    off = ConditioningCache(0)
    off.text("a", encode("a"))
    off.text("a", encode("a"))
    assert off.nbytes == 0 and off.take_report().lookups == {("text", "miss"): 2}


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux"])
def test_a_repeated_prompt_and_upload_hit_and_give_the_same_latents(pipes, name):
    pipe = pipes(name)
    rng = np.random.default_rng(0)
    upload = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.float32)
    mask[:32] = 1.0
    first = ImageRequest("a", "a red fox", 64, 64, 2, 4.0, seed=1, image=b"-")
    second = replace(first, request_id="b", seed=2)  # same prompt and upload, another seed

    def final_latents(runner: ModelRunner) -> dict[str, torch.Tensor]:
        for request in (first, second):
            runner.prepare(request, Upload(upload, EditMask(mask)))
        for _ in range(2):
            assert not runner.execute(Batch(("a", "b"))).failed
        return {rid: runner.states[rid].latents for rid in ("a", "b")}

    cached = ModelRunner(pipe, conditioning_bytes=64 << 20)
    with_cache, without = final_latents(cached), final_latents(ModelRunner(pipe))
    assert all(torch.equal(with_cache[rid], without[rid]) for rid in ("a", "b"))
    lookups = cached.conditioning.take_report().lookups
    assert lookups[("text", "hit")] == 1 and lookups[("text", "miss")] == 1
    assert lookups[("vae", "hit")] >= 1 and cached.conditioning.nbytes > 0


def test_the_engine_counts_conditioning_lookups_in_its_metrics(pipes):
    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(), make_policy(SchedulerConfig(policy="orca")))

    async def scenario():
        await engine.start()
        handle = await engine.submit(images("twice", n=2, steps=2))  # two images of one prompt
        await handle.images()
        await engine.aclose()

    run(scenario())
    assert samples(engine, "gouache_conditioning_cache") == {"miss": 1.0, "hit": 1.0}  # the family of _total
    assert samples(engine, "gouache_conditioning_cache_bytes")[None] > 0
