"""No single request stops the engine or fails its neighbours; a dead loop is reported."""

import asyncio
import time

import numpy as np
import pytest

from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
from gouache.engine.build import build_engine
from gouache.engine.client import AsyncEngine
from gouache.errors import EngineStoppedError, GouacheError, InvalidRequestError
from gouache.outputs import ErrorEvent, ImageEvent, ProgressEvent
from gouache.request import ImageRequest
from gouache.runner.describe import model_info
from gouache.sched.costmodel import BatchCostModel
from gouache.sched.policies import make_policy

from .test_async_engine import images, png, run

POLICIES = ["orca", "patched", "patched-slo", "round-knapsack", "fcfs-static"]


def cost_model_of_64px() -> BatchCostModel:
    """A tiny-sdxl cost model profiled at 64x64 only: 1-8 images, patched and plain."""
    model = BatchCostModel([64], patch_px=32)
    for batch in range(1, 9):
        model.record({(64, 64): batch}, 0.01 * batch)
        model.record_grouped(64, batch, 0.01 * batch)
    return model


def make_engine(pipes, policy: str, predictor=None, name: str = "tiny-sdxl") -> AsyncEngine:
    pipe = pipes(name)
    if predictor is None and policy in ("patched-slo", "round-knapsack"):
        predictor = cost_model_of_64px()
    return AsyncEngine(pipe, model_info(pipe, name), EngineConfig(patch_pixels=32),
                       make_policy(SchedulerConfig(policy=policy, round_s=0.05), predictor), predictor=predictor)


async def outcome(handle) -> str:
    """'images' or the error kind the request ended with."""
    try:
        await handle.images()
    except GouacheError as error:
        return error.kind
    return "images"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_whose_forward_raises_fails_alone(pipes, policy):
    """Before: the step's exception failed every request of the step with worker_failure."""
    engine = make_engine(pipes, policy)
    predict = engine.runner.family.predict

    def poisoned(states, patched, blocks=None):
        if any(s.request.prompt == "poison" for s in states):
            raise RuntimeError("this request breaks the model")
        return predict(states, patched, blocks)

    engine.runner.family.predict = poisoned

    async def scenario():
        await engine.start()
        mates = [await engine.submit(images(f"mate{i}", steps=4)) for i in range(2)]
        poison = await engine.submit([ImageRequest("poison-0", "poison", 64, 64, 4, 5.0, seed=0,
                                                   arrival_time=time.monotonic())])
        results = [await outcome(h) for h in (*mates, poison)]
        after = await outcome(await engine.submit(images("after", steps=2)))
        await engine.aclose()
        return results, after

    results, after = run(scenario())
    assert results == ["images", "images", "worker_failure"]
    assert after == "images"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_size_the_cost_model_never_saw_is_refused_at_admission_or_served(pipes, policy):
    """Before: under patched-slo and round-knapsack, the 96 px request made the cost model
    raise inside schedule(); the loop died. Policies without a cost model serve it."""
    engine = make_engine(pipes, policy)

    async def scenario():
        await engine.start()
        try:
            unseen = await outcome(await engine.submit(images("big", size=96, steps=2)))
        except InvalidRequestError as refused:
            unseen = refused
        served = await outcome(await engine.submit(images("fine", steps=2)))
        await engine.aclose()
        return unseen, served

    unseen, served = run(scenario())
    assert served == "images"
    if policy in ("patched-slo", "round-knapsack"):
        assert unseen.param == "size" and "64x64" in unseen.message and "96x96" in unseen.message
        assert engine.info.sizes == ((64, 64),)
    else:
        assert unseen == "images" and engine.info.sizes is None


class _RaisesAt96:
    """A predictor that claims to price every size but raises on 96 px images."""

    def step_time(self, resolutions, patched, degree=1):
        if (96, 96) in resolutions:
            raise ValueError("no profile of 96x96")
        return 0.01 * len(resolutions)

    def sizes(self, patched):
        return None


@pytest.mark.parametrize("policy", ["patched-slo", "round-knapsack"])
def test_a_planning_error_fails_the_request_it_concerns_and_not_the_loop(pipes, policy):
    engine = make_engine(pipes, policy, predictor=_RaisesAt96())

    async def scenario():
        await engine.start()
        fine = await engine.submit(images("fine", steps=6))
        unplannable = await engine.submit(images("big", steps=6, size=96))
        results = [await outcome(fine), await outcome(unplannable)]
        after = await outcome(await engine.submit(images("after", steps=2)))
        alive = engine.core.running
        await engine.aclose()
        return results, after, alive

    results, after, alive = run(scenario())
    assert results == ["images", "worker_failure"] and after == "images" and alive


def test_cancelling_a_previewing_request_mid_step_fails_no_other(pipes):
    """Before: the post stage released the cancelled request's state while the engine still had
    it in the step (KeyError), and every request of that step failed with worker_failure.

    The interleaving is made exact: the preview's request is cancelled and its preview job
    handled while the engine is inside the step, in the forward of a shape before the stream's."""
    engine = make_engine(pipes, "orca")
    forward, streams = engine.runner.family.forward, {}

    def forward_then_race(states):
        out = forward(states)
        streamed = engine.runner.states.get("stream-0")
        if streamed is not None and streamed.step == 3 and "stream" in streams:
            streams.pop("stream").abort()  # the client goes away...
            engine._postprocess([("preview", "stream-0", streamed.latents)])  # ...while its preview job runs
        return out

    engine.runner.family.forward = forward_then_race

    async def scenario():
        await engine.start()
        victims = [await engine.submit(images(f"v{size}", steps=8, size=size)) for size in (96, 128, 64)]
        streams["stream"] = await engine.submit(images("stream", steps=8, partial_images=3))
        results = [await outcome(h) for h in victims]
        await engine.aclose()
        return results

    assert run(scenario()) == ["images"] * 3


@pytest.mark.parametrize("policy", POLICIES)
def test_cancelled_streams_with_previews_leave_other_requests_whole(pipes, policy):
    """Three previewing 64 px streams cancelled at step 3 among requests of other sizes."""
    engine = make_engine(pipes, policy)
    sizes = (64, 64, 64) if policy in ("patched-slo", "round-knapsack") else (128, 96, 64)

    async def cancel_at_step_3(handle):
        async for event in handle:
            if isinstance(event, ProgressEvent) and event.step == 3:
                handle.abort()
            if isinstance(event, ErrorEvent | ImageEvent):
                return

    async def scenario():
        await engine.start()
        victims = [await engine.submit(images(f"v{i}", steps=10, size=size)) for i, size in enumerate(sizes)]
        streams = [await engine.submit(images(f"s{i}", steps=8, partial_images=3)) for i in range(3)]
        await asyncio.gather(*(cancel_at_step_3(s) for s in streams))
        results = [await outcome(h) for h in victims]
        await engine.aclose()
        return results

    assert run(scenario()) == ["images"] * 3


@pytest.mark.parametrize("name", ["tiny-sd-inpaint", "tiny-sdxl-inpaint"])
def test_generation_on_an_inpainting_model_repaints_a_blank_image(pipes, name):
    """Before: 500 ('NoneType' object has no attribute 'latent_mask'), and it took down the
    edits batched with it."""
    engine = make_engine(pipes, "orca", name=name)
    upload = png(np.full((64, 64, 3), 200, np.uint8))

    async def scenario():
        await engine.start()
        edit = await engine.submit(images("edit", steps=3, image=upload))
        generation = await engine.submit(images("gen", steps=3))
        results = [await h.images() for h in (edit, generation)]
        await engine.aclose()
        return results

    edit, generation = run(scenario())
    assert len(edit) == 1 and len(generation) == 1


def test_a_dead_engine_loop_is_reported_and_fails_what_is_in_flight(pipes):
    engine = make_engine(pipes, "orca")

    def broken_advance(run, stepped, now, steps=1):
        raise SystemError("a bug in the loop")

    engine.scheduler.advance = broken_advance

    async def scenario():
        await engine.start()
        result = await outcome(await engine.submit(images("doomed", steps=3)))
        await asyncio.wait_for(engine.died.wait(), 10)
        status = engine.stats().status
        with pytest.raises(GouacheError) as refused:
            await engine.submit(images("later"))
        await engine.aclose()
        return result, status, refused.value.kind

    assert run(scenario()) == ("engine_stopped", "dead", "engine_stopped")


@pytest.mark.parametrize("stage", ["prepare", "decode_many"])
def test_a_stage_job_that_raises_fails_its_request_and_the_stage_goes_on(pipes, stage):
    """A poisoned request's preparation or decode raises (a decode of several images at once then
    runs each alone): it fails, its batch-mate is served."""
    engine = make_engine(pipes, "orca")
    original = getattr(engine.runner.family, stage)

    def poisoned(states_or_request, *args):
        states = states_or_request if isinstance(states_or_request, list) else [states_or_request]
        if any(getattr(s, "request", s).prompt == "poison" for s in states):
            raise RuntimeError(f"{stage} breaks on this request")
        return original(states_or_request, *args)

    setattr(engine.runner.family, stage, poisoned)

    async def scenario():
        await engine.start()
        poison = await engine.submit([ImageRequest("poison-0", "poison", 64, 64, 3, 5.0, seed=0,
                                                   arrival_time=time.monotonic())])
        mate = await engine.submit(images("mate", steps=3))
        results = [await outcome(poison), await outcome(mate)]
        left = len(engine.runner.states)
        await engine.aclose()
        return results, left

    assert run(scenario()) == (["worker_failure", "images"], 0)


async def ending(handle, started: asyncio.Event | None = None) -> tuple[str, str, int]:
    """(kind, message, HTTP status) the request ended with ('images', '', 200 for images); sets
    `started` at its first step."""
    async for event in handle:
        if isinstance(event, ProgressEvent) and started is not None:
            started.set()
        if isinstance(event, ErrorEvent):
            return event.kind, event.message, event.status
        if isinstance(event, ImageEvent):
            return "images", "", 200
    raise AssertionError("the request's events ended without an image or an error")


@pytest.mark.slow
def test_fixed_sp_2_stops_when_a_worker_dies_and_every_request_ends():
    """Issue 32, item 3. Before: the request on the dead worker failed, the others (and any new
    one) waited until the request timeout, and the engine said ok: fixed-sp-2 needs an aligned
    pair of live devices and one of two can never give it. Now the engine stops as when every
    device dies: the waiting requests fail with 503 saying why, new ones are refused."""
    engine = build_engine(ModelConfig("tiny-sd"),
                          EngineConfig(executor="multiproc", devices=2, torch_threads=1),
                          SchedulerConfig(policy="fixed-sp-2"))

    async def scenario():
        await engine.start()
        try:
            started = asyncio.Event()
            handles = [await engine.submit(images(f"r{i}", steps=40)) for i in range(3)]
            ends = [asyncio.create_task(ending(h, started if i == 0 else None)) for i, h in enumerate(handles)]
            await asyncio.wait_for(started.wait(), 60)  # r0 runs on both devices; r1 and r2 wait
            engine.pool.executor.kill(1)
            results = await asyncio.wait_for(asyncio.gather(*ends), 60)
            await asyncio.wait_for(engine.died.wait(), 10)
            with pytest.raises(EngineStoppedError) as refused:
                await engine.submit(images("later"))
            return results, engine.stats().status, refused.value
        finally:
            await engine.aclose()

    results, status, refused = run(scenario())
    (kind, message, code), *waiting = results
    assert (kind, code) == ("worker_failure", 500) and "device 1 died" in message
    for kind, message, code in waiting:
        assert (kind, code) == ("engine_stopped", 503)
        assert "'fixed-sp-2'" in message and "device 1" in message and "aligned block of 2 live devices" in message
    assert status == "dead" and refused.status == 503
