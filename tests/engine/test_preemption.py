"""Preemption at step boundaries (`gouache.sched.tiers`): a running flex request that a priority
request's arrival pauses resumes later and ends with the latents it would have had unpaused,
in every family, under each policy that pauses, its state kept on the device or parked in host
memory (`DevicePool.park`)."""

import pytest
import torch

from gouache.config import SchedulerConfig
from gouache.request import ImageRequest, Tier
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler
from tests.engine.test_exactness import FAMILIES, FlatCost, run_engine

CASES = [(name, "orca") for name in FAMILIES] + [(name, policy) for name in ("tiny-sdxl", "tiny-flux")
                                                 for policy in ("patched", "patched-slo")]


def request(rid: str, tier: str, seed: int, steps: int = 4, width: int = 64, **fields) -> ImageRequest:
    return ImageRequest(rid, "a red fox", width, 64, steps, 5.0, seed, tier=Tier.named(tier), **fields)


@pytest.mark.parametrize("parked", [False, True], ids=["on-device", "parked"])
@pytest.mark.parametrize(("name", "policy"), CASES)
def test_a_paused_and_resumed_request_equals_itself_unpaused(pipes, name, policy, parked):
    from gouache.executor.pool import DevicePool
    from gouache.runner.model_runner import ModelRunner

    pipe = pipes(name)
    predictor = FlatCost() if policy == "patched-slo" else None
    one_slot = Scheduler(make_policy(SchedulerConfig(policy=policy, max_batch_size=1), predictor))
    pool = DevicePool.in_process(ModelRunner(pipe, patch_pixels=32), park_bytes=(1 << 30) * parked)
    alone = run_engine(pipe, {0: [request("flex", "flex", seed=3)]}, policy)["flex"]
    paused = {}
    original_add = one_slot.add

    def add(state):  # the flex request's state, to read its pauses once it is done
        paused.setdefault(state.request_id, state)
        original_add(state)

    one_slot.add = add
    latents = run_engine(pipe, {0: [request("flex", "flex", seed=3)],
                                2: [request("priority", "priority", seed=4, steps=2, width=96)]},
                         policy, scheduler=one_slot, pool=pool)
    assert paused["flex"].pauses == 1 and paused["priority"].pauses == 0
    assert (latents["flex"] - alone).abs().max() <= 1e-4
    assert pool.parks == parked and not pool.parked  # parked while paused, back on the device to finish


@pytest.mark.parametrize("parked", [False, True], ids=["on-device", "parked"])
@pytest.mark.parametrize("technique", ["lora", "block_cache"])
def test_a_paused_request_keeps_what_its_techniques_hold(pipes, tmp_path, technique, parked):
    """A pause is no forward technique: a paused request takes part in no forward. What its
    techniques keep between its steps (merged or segmented adapters, cached block outputs)
    is its own, so it resumes as it would have gone on, its state parked in host memory or not."""
    from safetensors.torch import save_file

    from gouache.config import BlockCacheConfig, LoraConfig
    from gouache.executor.pool import DevicePool
    from gouache.lora.files import random_lora
    from gouache.runner.model_runner import ModelRunner

    pipe = pipes("tiny-sdxl")
    save_file(random_lora(pipe, rank=4, seed=0), str(tmp_path / "ink.safetensors"))
    fields = {"loras": (("ink", 1.0),)} if technique == "lora" else {"block_cache": 0.5}

    def runner() -> ModelRunner:
        return ModelRunner(pipe, lora=LoraConfig(str(tmp_path)), block_cache=BlockCacheConfig(max_reuse=2))

    flex = request("flex", "flex", seed=3, steps=6, **fields)
    alone = run_engine(pipe, {0: [flex]}, "orca", runner())["flex"]
    one_slot = Scheduler(make_policy(SchedulerConfig(policy="orca", max_batch_size=1)))
    pool = DevicePool.in_process(runner(), park_bytes=(1 << 30) * parked)
    latents = run_engine(pipe, {0: [request("flex", "flex", seed=3, steps=6, **fields)],
                                3: [request("priority", "priority", seed=4, steps=2, width=96)]},
                         "orca", scheduler=one_slot, pool=pool)
    assert (latents["flex"] - alone).abs().max() <= 1e-4 and pool.parks == parked
    plain = run_engine(pipe, {0: [request("flex", "flex", seed=3, steps=6)]}, "orca", runner())["flex"]
    assert (alone - plain).abs().max() > 1e-3  # the technique did something to keep


def test_a_served_flex_request_is_paused_for_a_priority_one_and_says_so(pipes):
    """Through the engine: the flex stream gets `PausedEvent` at the step it stopped, resumes,
    and both images come back; /v1/status shows each image's tier; the pause is counted; its
    state waited in host memory (--paused-host-mb)."""
    import asyncio

    from gouache.config import EngineConfig
    from gouache.engine.client import AsyncEngine
    from gouache.outputs import ImageEvent, PausedEvent, ProgressEvent
    from gouache.runner.describe import model_info
    from tests.engine.test_async_engine import images

    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(paused_host_bytes=1 << 30),
                         make_policy(SchedulerConfig(policy="orca", max_batch_size=1)))

    async def scenario():
        await engine.start()
        flex = await engine.submit(images("flex", steps=40, tier=Tier.FLEX))
        events, statuses = [], []
        async for event in flex:
            events.append(event)
            if isinstance(event, ProgressEvent) and event.step == 1:
                priority = await engine.submit(images("priority", steps=2, tier=Tier.PRIORITY))
            if isinstance(event, PausedEvent):
                statuses.append(await engine.status())
        await priority.images()
        await engine.aclose()
        return events, statuses

    events, statuses = asyncio.run(scenario())
    [pause] = [e for e in events if isinstance(e, PausedEvent)]
    steps = [e.step for e in events if isinstance(e, ProgressEvent)]
    assert steps == list(range(1, 41)) and pause.step in steps and pause.total_steps == 40
    assert isinstance(events[-1], ImageEvent)
    [flex] = [r for r in statuses[0]["requests"] if r["id"] == "flex-0"]
    assert flex["service_tier"] == "flex" and flex["status"] in ("paused", "running")
    samples = {s.labels["tier"]: s.value for m in engine.metrics.registry.collect() if m.name == "gouache_pauses"
               for s in m.samples if s.name.endswith("_total")}
    assert samples == {"flex": 1.0}
    assert engine.pool.parks == 1 and engine.pool.parked_bytes == 0  # parked while paused, resumed since


def test_flex_requests_get_429_first_under_load(pipes):
    import asyncio

    from gouache.config import EngineConfig
    from gouache.engine.client import AsyncEngine
    from gouache.errors import QueueFullError
    from gouache.runner.describe import model_info
    from tests.engine.test_async_engine import images

    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"),
                         EngineConfig(max_queue_len=4, tier_queue_share=(("flex", 0.5),)),
                         make_policy(SchedulerConfig(policy="orca")))

    async def scenario():
        await engine.start()
        first = await engine.submit(images("default", n=2, steps=20))
        with pytest.raises(QueueFullError, match="flex requests' limit 2"):
            await engine.submit(images("flex", tier=Tier.FLEX))
        second = await engine.submit(images("more", n=2, steps=2))  # the default tier's limit is 4
        await first.images()
        await second.images()
        await engine.aclose()

    asyncio.run(scenario())


def test_a_tenant_over_its_share_of_the_queue_gets_429_and_the_other_does_not(pipes):
    """Two tenants of equal weight in one tier share its places: past half of them the
    tenant that holds them is refused, naming its share; the other still gets in."""
    import asyncio
    from dataclasses import replace

    from gouache.config import EngineConfig
    from gouache.engine.client import AsyncEngine
    from gouache.errors import QueueFullError
    from gouache.runner.describe import model_info
    from tests.engine.test_async_engine import images

    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(max_queue_len=4),
                         make_policy(SchedulerConfig(policy="orca")))

    def of(tenant, name, **fields):
        return [replace(r, tenant=tenant) for r in images(name, **fields)]

    async def scenario():
        await engine.start()
        handles = [await engine.submit(of("quiet", "q0", steps=20)), await engine.submit(of("loud", "l0", steps=20)),
                   await engine.submit(of("loud", "l1", steps=20))]
        with pytest.raises(QueueFullError, match="tenant 'loud' holds its share of the default queue \\(2 of 2"):
            await engine.submit(of("loud", "l2"))
        handles.append(await engine.submit(of("quiet", "q1", steps=2)))  # 2 of its 2
        for handle in handles:
            await handle.images()
        await engine.aclose()

    asyncio.run(scenario())


def test_parking_keeps_to_its_budget_and_a_release_frees_what_it_held(pipes):
    """Paused states park in the order given while they fit (the driver counts each by its
    tensors' bytes, then by what the parked copy takes); a released one frees its share."""
    from gouache.executor.pool import DevicePool
    from gouache.runner.model_runner import ModelRunner
    from gouache.runner.sampler import DenoiseState, Parked
    from gouache.sched.plan import Batch

    runner = ModelRunner(pipes("tiny-sdxl"))
    for rid, seed in (("a", 1), ("b", 2)):
        runner.prepare(request(rid, "flex", seed))
    size = runner.states["a"].nbytes()
    pool = DevicePool.in_process(runner, park_bytes=size * 3 // 2)  # room for one of the two
    pool.park(["a"])
    assert pool.parks == 0  # never stepped: its state is the driver's, nothing to move
    pool.submit(Batch(("a", "b"))).result()
    pool.park(["a", "b"])
    assert isinstance(runner.states["a"], Parked) and isinstance(runner.states["b"], DenoiseState)
    assert pool.parked == {"a": len(runner.states["a"].blob)} and pool.parks == 1
    pool.release("a")
    assert not pool.parked and "a" not in runner.states
    pool.park(["b"])
    assert pool.parks == 2 and isinstance(runner.states["b"], Parked)
    pool.submit(Batch(("b",))).result()  # its next step brings it back
    assert isinstance(runner.states["b"], DenoiseState) and runner.states["b"].step == 2 and not pool.parked


@pytest.mark.parametrize("parked", [False, True], ids=["on-device", "parked"])
@pytest.mark.parametrize("technique", ["controlnet", "template"])
def test_a_paused_controlnet_or_template_request_resumes_as_it_would_have_gone_on(pipes, tmp_path, technique, parked):
    """What a ControlNet request holds between steps (its control image's conditioning) and what
    a template edit holds (the template it records, then the one it replays) stay its own
    while it is paused: the edit that records a template and the one that replays it, each
    paused after its first step, end as they do unpaused."""
    from gouache.config import ControlNetConfig
    from gouache.controlnet.model import random_controlnet
    from gouache.executor.pool import DevicePool
    from gouache.runner.model_runner import ModelRunner
    from tests.engine.test_compose import MODEL, member

    pipe = pipes(MODEL)
    random_controlnet(pipe, seed=0, std=0.2).save_pretrained(str(tmp_path / "edges"))

    def runner() -> ModelRunner:
        return ModelRunner(pipe, patch_pixels=32, controlnet=ControlNetConfig(str(tmp_path)))

    def serve(first: bool, paused: bool, uses: tuple[str, ...] = (technique,)) -> torch.Tensor:
        """The flex request's latents: the first edit of its image, or the second (a replay)."""
        one_slot = Scheduler(make_policy(SchedulerConfig(policy="orca", max_batch_size=1)))
        pool = DevicePool.in_process(runner(), park_bytes=(1 << 30) * parked)
        if not first:
            run_engine(pipe, {0: [member("record", uses, seed=5)]}, "orca", scheduler=one_slot, pool=pool)
        states, add = {}, one_slot.add
        one_slot.add = lambda state: (states.setdefault(state.request_id, state), add(state))
        arrivals = {0: [member("flex", uses, seed=3)],
                    **({1: [request("priority", "priority", seed=4, steps=2, width=96)]} if paused else {})}
        latents = run_engine(pipe, arrivals, "orca", scheduler=one_slot, pool=pool)["flex"]
        assert states["flex"].pauses == paused and pool.parks == (parked and paused)
        return latents

    unpaused = {first: serve(first, paused=False) for first in ((True, False) if technique == "template" else (True,))}
    for first, latents in unpaused.items():
        assert (serve(first, paused=True) - latents).abs().max() <= 1e-4
    if technique == "controlnet":  # the technique did something to keep
        assert (serve(True, paused=False, uses=()) - unpaused[True]).abs().max() > 1e-3  # the ControlNet steers
    else:
        assert (unpaused[False] - unpaused[True]).abs().max() > 1e-3  # the second edit replays the first's template
