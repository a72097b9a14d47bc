"""The threaded engine: continuous batching, abort, errors, limits."""

import asyncio
import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
from gouache.engine.build import build_engine
from gouache.engine.client import AsyncEngine
from gouache.errors import GouacheError, InvalidRequestError, QueueFullError
from gouache.outputs import ImageEvent, PartialImageEvent, ProgressEvent
from gouache.request import ImageRequest
from gouache.runner.describe import model_info
from gouache.sched.calibration import BOUNDS, WEIGHT, Calibrated
from gouache.sched.policies import make_policy


def make_engine(pipes, policy="orca", **engine_kwargs) -> AsyncEngine:
    pipe = pipes("tiny-sdxl")
    return AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(**engine_kwargs),
                       make_policy(SchedulerConfig(policy=policy)))


def images(api_id: str, n: int = 1, steps: int = 4, size: int = 64, **kwargs) -> list[ImageRequest]:
    now = time.monotonic()
    return [ImageRequest(f"{api_id}-{i}", "a fox", size, size, steps, 5.0, seed=i, arrival_time=now, **kwargs)
            for i in range(n)]


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def run(coro):
    return asyncio.run(coro)


def record_steps(engine: AsyncEngine) -> list[list[str]]:
    """Wrap the engine's step callback to log which requests each step ran."""
    log, inner = [], engine.core.on_step

    def on_step(report):
        log.append(list(report.batch.request_ids))
        inner(report)

    engine.core.on_step = on_step
    return log


@pytest.mark.parametrize("policy, joins", [("orca", True), ("fcfs-static", False)])
def test_request_submitted_while_another_runs_starts_within_one_step(pipes, policy, joins):
    engine = make_engine(pipes, policy)
    steps = record_steps(engine)
    ready_at = []  # steps reported when the short request reached the engine loop's inbox
    add = engine.core.add

    def noting_add(state):
        if state.request_id == "short-0":
            ready_at.append(len(steps))
        add(state)

    engine.core.add = noting_add

    async def scenario():
        await engine.start()
        long = await engine.submit(images("long", steps=30))
        async for event in long:
            if isinstance(event, ProgressEvent) and event.step == 3:
                break
        short = await engine.submit(images("short", steps=2))
        await short.images()
        await long.images()
        await engine.aclose()

    run(scenario())
    first_short = next(i for i, ids in enumerate(steps) if "short-0" in ids)
    last_long = max(i for i, ids in enumerate(steps) if "long-0" in ids)
    if joins:  # at most the step already under way when it arrived runs without it
        assert first_short <= ready_at[0] + 1 and first_short < last_long
    else:  # static batching: it waits for the whole long batch
        assert first_short == last_long + 1


def test_n_images_stream_progress_previews_and_images(pipes):
    engine = make_engine(pipes)

    async def scenario():
        await engine.start()
        handle = await engine.submit(images("r", n=2, steps=6, partial_images=2))
        events = [e async for e in handle]
        await engine.aclose()
        return events

    events = run(scenario())
    finals = [e for e in events if isinstance(e, ImageEvent)]
    assert sorted(e.index for e in finals) == [0, 1]
    assert all(Image.open(io.BytesIO(e.image)).size == (64, 64) for e in finals)
    assert [e.step for e in events if isinstance(e, ProgressEvent) and e.index == 0] == list(range(1, 7))
    assert sum(isinstance(e, PartialImageEvent) for e in events) == 4
    assert engine.stats().finished == 2


def test_abort_frees_the_slot_and_the_engine_goes_on(pipes):
    engine = make_engine(pipes)

    async def scenario():
        await engine.start()
        doomed = await engine.submit(images("doomed", steps=200))
        async for event in doomed:
            if isinstance(event, ProgressEvent):
                break
        doomed.abort()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if not engine.scheduler.running and not engine.runner.states:
                break
        freed = not engine.scheduler.running and not engine.runner.states
        result = await (await engine.submit(images("next", steps=2))).images()
        await engine.aclose()
        return freed, result

    freed, result = run(scenario())
    assert freed and len(result) == 1


def test_queue_limit_raises_queue_full(pipes):
    engine = make_engine(pipes, max_queue_len=2)

    async def scenario():
        await engine.start()
        first = await engine.submit(images("a", n=2, steps=50))
        with pytest.raises(QueueFullError) as error:
            await engine.submit(images("b"))
        first.abort()
        await engine.aclose()
        return error.value

    error = run(scenario())
    assert error.status == 429 and error.retry_after_s >= 1


def test_timeout_is_an_explicit_error(pipes):
    engine = make_engine(pipes, request_timeout_s=0.3)

    async def scenario():
        await engine.start()
        handle = await engine.submit(images("slow", steps=200))
        with pytest.raises(GouacheError) as error:
            await handle.images()
        await engine.aclose()
        return error.value

    error = run(scenario())
    assert error.kind == "timeout" and error.status == 504


def test_edit_keeps_unmasked_pixels_and_rejects_bad_uploads(pipes):
    engine = make_engine(pipes)
    rng = np.random.default_rng(0)
    original = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0  # transparent square = repaint

    async def scenario():
        await engine.start()
        edit = await engine.submit(images("e", image=png(original), mask=png(mask)))
        result = await edit.images()
        with pytest.raises(InvalidRequestError) as not_image:
            await engine.submit(images("x", image=b"not an image"))
        with pytest.raises(InvalidRequestError) as mismatch:
            await engine.submit(images("y", image=png(original), mask=png(mask[:32])))
        await engine.aclose()
        return result, not_image.value, mismatch.value

    result, not_image, mismatch = run(scenario())
    out = np.asarray(Image.open(io.BytesIO(result[0].image)).convert("RGB"))
    keep = mask[..., 3] == 255
    assert np.array_equal(out[keep], original[keep])
    assert not np.array_equal(out[~keep], original[~keep])
    assert not_image.param == "image" and mismatch.param == "mask"


def test_an_edit_that_repaints_nothing_returns_the_original_without_a_step(pipes):
    engine = make_engine(pipes)
    steps = record_steps(engine)
    original = np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    black = np.zeros((64, 64, 3), np.uint8)  # opaque, no white pixel: nothing to repaint

    async def scenario():
        await engine.start()
        result = await (await engine.submit(images("e", image=png(original), mask=png(black)))).images()
        await engine.aclose()
        return result

    [event] = run(scenario())
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(event.image)).convert("RGB")), original)
    assert steps == [] and not engine.runner.states


def test_patched_engine_serves_mixed_sizes_in_one_forward(pipes):
    pipe = pipes("tiny-sdxl")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(patch_pixels=32),
                         make_policy(SchedulerConfig(policy="patched")))
    steps = record_steps(engine)
    assert engine.info.size_step == 16  # the model's own: each forward picks patches that cut its sizes

    async def scenario():
        await engine.start()
        now = time.monotonic()
        handles = [
            await engine.submit([ImageRequest(f"{w}x{h}-0", "a fox", w, h, 4, 5.0, seed=1, arrival_time=now)])
            for w, h in ((64, 64), (96, 64), (64, 128))
        ]
        results = [await handle.images() for handle in handles]
        await engine.aclose()
        return results

    results = run(scenario())
    sizes = [Image.open(io.BytesIO(r[0].image)).size for r in results]
    assert sizes == [(64, 64), (96, 64), (64, 128)]
    assert max(len(ids) for ids in steps) == 3  # all three sizes in one step's single forward


def test_patched_serves_every_size_the_model_takes_equal_to_one_forward_per_size(pipes):
    # the patch side was 128 px whatever the model: shapes-unet's 64-128 px sizes were 400s
    pipe = pipes("shapes-unet")
    sizes = ((64, 64), (96, 96), (128, 64), (64, 128), (128, 128))
    results = {}
    for policy in ("patched", "orca"):
        engine = AsyncEngine(pipe, model_info(pipe, "shapes-unet"), EngineConfig(),
                             make_policy(SchedulerConfig(policy=policy)))
        assert engine.info.size_step == 32
        steps = record_steps(engine)

        async def scenario():
            await engine.start()
            now = time.monotonic()
            handles = [await engine.submit([ImageRequest(f"{w}x{h}-0", "a red circle", w, h, 3, 5.0, seed=1,
                                                         arrival_time=now)]) for w, h in sizes]
            out = [(await handle.images())[0] for handle in handles]
            await engine.aclose()
            return out

        results[policy] = [np.asarray(Image.open(io.BytesIO(event.image))).astype(int) for event in run(scenario())]
        if policy == "patched":
            assert max(len(ids) for ids in steps) == len(sizes)  # one forward: 32 px patches fit them all
    for patched, plain in zip(results["patched"], results["orca"]):
        assert np.abs(patched - plain).max() <= 1


def test_the_largest_patch_that_fits_every_image_of_a_forward_is_used(pipes):
    from gouache.runner.families import make_family

    family = make_family(pipes("shapes-unet"), None)  # latents of 8 to 16 cells; patches of 4, 8 or 16
    assert [family.layout([torch.zeros(4, h, w) for h, w in shapes]).patch
            for shapes in ([(16, 16)], [(16, 16), (8, 16)], [(16, 16), (12, 12)], [(8, 8), (12, 8)])] == [16, 8, 4, 4]
    assert make_family(pipes("shapes-unet"), 64).layout([torch.zeros(4, 16, 16)]).patch == 8  # capped at 64 px
    with pytest.raises(ValueError, match="multiple of 32 pixels"):
        make_family(pipes("shapes-unet"), 48)


def test_a_patch_size_is_refused_for_a_dit_which_would_ignore_it():
    with pytest.raises(ValueError, match="--patch-size would be ignored: sd3 models"):
        build_engine(ModelConfig("tiny-sd3"), EngineConfig(patch_pixels=32), SchedulerConfig(policy="patched"))


class _Fixed:
    """A predictor that says every step takes 50 ms, whatever the batch."""

    def step_time(self, resolutions, patched, degree=1):
        return 0.05

    def sizes(self, patched):
        return None


def test_unattainable_deadline_is_an_explicit_error(pipes):
    pipe = pipes("tiny-sdxl")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(patch_pixels=32),
                         make_policy(SchedulerConfig(policy="patched-slo"), _Fixed()), predictor=_Fixed())

    async def scenario():
        await engine.start()
        hopeless = await engine.submit(images("hopeless", steps=20, slo_ms=100))  # needs >= 1 s
        with pytest.raises(GouacheError) as error:
            await hopeless.images()
        fine = await (await engine.submit(images("fine", steps=2, slo_ms=60_000))).images()
        await engine.aclose()
        return error.value, fine

    error, fine = run(scenario())
    assert error.kind == "deadline_unattainable" and error.status == 503 and len(fine) == 1


def test_the_engine_scales_its_cost_model_by_the_steps_it_measures(pipes):
    pipe = pipes("tiny-sdxl")
    calibrated = Calibrated(_Fixed())
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(),
                         make_policy(SchedulerConfig(policy="patched-slo"), calibrated), predictor=calibrated)
    measured, inner = [], engine.core.on_step

    def on_step(report):
        measured.append(report.step_s)
        inner(report)

    engine.core.on_step = on_step

    async def scenario():
        await engine.start()
        await (await engine.submit(images("a", n=2, steps=4, slo_ms=60_000))).images()
        await engine.aclose()

    run(scenario())
    expected = 1.0
    for seconds in measured:  # each step's wall time over the 50 ms predicted, as a running mean
        expected += WEIGHT * (min(max(seconds / 0.05, BOUNDS[0]), BOUNDS[1]) - expected)
    assert len(measured) >= 4 and calibrated.observed == len(measured)
    assert calibrated.scale == pytest.approx(expected, rel=1e-12) and calibrated.scale != 1.0
    assert engine.metrics.step_time_scale._value.get() == calibrated.scale
    assert calibrated.step_time([(64, 64)], patched=True) == pytest.approx(0.05 * expected)


def test_round_knapsack_serves_live_one_shape_per_step(pipes):
    pipe = pipes("tiny-sdxl")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(),
                         make_policy(SchedulerConfig(policy="round-knapsack", round_s=0.1), _Fixed()),
                         predictor=_Fixed())
    steps = record_steps(engine)
    shapes = {"a-0": 64, "a-1": 64, "b-0": 96, "c-0": 64}

    async def scenario():
        await engine.start()
        handles = [await engine.submit(images("a", n=2, steps=3)),
                   await engine.submit(images("b", steps=3, size=96, slo_ms=60_000)),
                   await engine.submit(images("c", steps=3))]
        results = [await handle.images() for handle in handles]
        await engine.aclose()
        return results

    results = run(scenario())
    assert [len(r) for r in results] == [2, 1, 1]
    assert all(len({shapes[rid] for rid in ids}) == 1 for ids in steps)  # rounds batch one resolution only
    assert sorted(rid for ids in steps for rid in ids) == sorted([rid for rid in shapes for _ in range(3)])
