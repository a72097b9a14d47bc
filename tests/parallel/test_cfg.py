"""CFG parallelism: a UNet's batch of degree 2 on two worker processes, the unconditional rows
on one and the conditional rows on the other, equals one device's run; a request without
guidance in the batch runs whole on both; ControlNet residuals are cut with the rows."""

import numpy as np
import pytest

from gouache.config import CompileConfig, ControlNetConfig, LoraConfig
from gouache.controlnet.model import random_controlnet
from gouache.executor.multiproc import MultiprocExecutor
from gouache.executor.worker import WorkerSpec
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload
from tests.lora.random_files import random_loras

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"
STEPS = 3


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("controlnets")
    random_controlnet(load_pipeline(MODEL), std=0.2).save_pretrained(str(directory / "edges"))
    return directory


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return random_loras(tmp_path_factory.mktemp("loras"), MODEL)


@pytest.fixture(scope="module")
def two_workers(control_dir, lora_dir):
    spec = WorkerSpec(MODEL, torch_threads=1, controlnet=ControlNetConfig(str(control_dir)),
                      lora=LoraConfig(str(lora_dir)))
    executor = MultiprocExecutor(spec, 2)
    yield executor
    executor.shutdown()


def requests(guidance=(4.0, 6.0)):
    cond = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    out = [(ImageRequest(f"g{i}", "a red circle", 64, 64, STEPS, g, seed=i), {}) for i, g in enumerate(guidance)]
    out.append((ImageRequest("edges", "a blue square", 64, 64, STEPS, 5.0, seed=7,
                             controlnets=(("edges", b"", 0.8),)), {"controls": [cond]}))
    return out


def steps(runner: ModelRunner, load, executor=None, modes: list | None = None,
          compiles: list | None = None) -> tuple[dict, list]:
    """Every request's STEPS steps in one batch of degree 2 on `executor`'s two workers (or on
    `runner` alone): final latents, and the seconds each step spent exchanging halves; each
    step's LoRA mode goes to `modes`, each rank's compile report to `compiles`."""
    states = {r.request_id: None for r, _ in load}
    for r, inputs in load:
        runner.prepare(r, **inputs)
        states[r.request_id] = runner.states[r.request_id]
        for name, _ in r.loras:  # on one device a step leaves out a request whose adapters are still read
            runner.lora_runtime.store.load(name).result()
    ids = tuple(states)
    collectives = []
    for k in range(STEPS):
        if executor is None:
            out = runner.execute(Batch(ids))
            assert not out.failed and out.request_ids == list(ids)
            continue
        incoming = {rid: runner.states[rid] for rid in ids} if k == 0 else {}
        outs = executor.collective_rpc("execute", (Batch(ids, (0, 1), 2), incoming), timeout=120)
        assert [o.step.request_ids for o in outs] == [list(ids)] * 2 and not outs[0].step.failed
        if modes is not None:
            modes.append(outs[0].step.lora.mode)
        if compiles is not None:
            compiles.extend(o.step.compile for o in outs)
        # the latents stay on the workers until the last step; both ranks end it alike
        assert set(outs[0].latents) == set(outs[1].latents) == (set(ids) if k == STEPS - 1 else set())
        for rid in outs[0].latents:
            assert (outs[0].latents[rid] - outs[1].latents[rid]).abs().max() == 0
            runner.states[rid].latents = outs[0].latents[rid]
        collectives.append(outs[0].step.collective_s)
    if executor is not None:
        executor.collective_rpc("release", (list(ids),))
    return {rid: runner.states.pop(rid).latents for rid in ids}, collectives


def test_cfg_parallel_equals_one_device(two_workers, control_dir):
    config = ControlNetConfig(str(control_dir))
    alone, _ = steps(ModelRunner(load_pipeline(MODEL), controlnet=config), requests())
    split, collectives = steps(ModelRunner(load_pipeline(MODEL), controlnet=config), requests(), two_workers)
    for rid in alone:
        assert (alone[rid] - split[rid]).abs().max() <= 1e-4, rid
        assert alone[rid].abs().mean() > 0.1
    assert all(seconds > 0 for seconds in collectives)  # the halves were exchanged every step


def test_a_request_without_guidance_runs_whole_on_both_devices(two_workers, control_dir):
    config = ControlNetConfig(str(control_dir))
    load = requests(guidance=(4.0, 1.0))  # one request with a single row
    alone, _ = steps(ModelRunner(load_pipeline(MODEL), controlnet=config), load)
    split, collectives = steps(ModelRunner(load_pipeline(MODEL), controlnet=config), requests((4.0, 1.0)),
                               two_workers)
    for rid in alone:
        assert (alone[rid] - split[rid]).abs().max() <= 1e-4, rid
    assert collectives == [0.0] * STEPS  # nothing exchanged: both ran every row


def test_round_knapsack_gives_an_idle_device_to_a_unet_request_as_cfg_parallelism(two_workers):
    from tests.executor.test_multiproc import Loop, assert_equal_latents

    pooled, alone = Loop(two_workers, model=MODEL), Loop(model=MODEL)
    for loop in (pooled, alone):
        loop.add(ImageRequest("first", "a red circle", 64, 64, 6, 4.0, seed=1))
        loop.run(later=[ImageRequest("second", "a green square", 64, 64, 4, 4.0, seed=2)])
    assert not pooled.failed
    assert_equal_latents(pooled.latents, alone.latents)
    assert pooled.degrees["first"][0] == 2  # alone, it took both devices: its guidance rows apart


def adapters_alone_and_split(model: str, lora_dir, executor, compiles: list | None = None
                             ) -> tuple[dict, dict, list, list]:
    """Three requests (adapters ink, paper, none) in one batch, run on one device and at degree
    2 on `executor`'s workers: the final latents of each run, and each split step's LoRA mode
    and seconds in collectives (its ranks' compile reports to `compiles`)."""
    def load():
        return [(ImageRequest(f"l{i}", "a red circle", 64, 64, STEPS, 4.0, seed=i, loras=loras), {})
                for i, loras in enumerate(((("ink", 1.0),), (("paper", 0.5),), ()))]

    config = LoraConfig(str(lora_dir))
    alone, _ = steps(ModelRunner(load_pipeline(model), lora=config), load())
    modes = []
    split, collectives = steps(ModelRunner(load_pipeline(model), lora=config), load(), executor, modes, compiles)
    return alone, split, modes, collectives


def compiled_adapters_split(model: str, lora_dir, bucket: int) -> tuple[dict, dict, list, list]:
    """`adapters_alone_and_split` on two new workers compiling through dynamo's `eager` backend
    (the graphs' paths without inductor's code, which takes minutes cold in two workers of one
    thread), one row bucket: the latents, LoRA modes and each rank's compile report per step."""
    spec = WorkerSpec(model, torch_threads=1, lora=LoraConfig(str(lora_dir)),
                      compile=CompileConfig(enabled=True, buckets=(bucket,), sizes=((64, 64),), backend="eager"))
    executor = MultiprocExecutor(spec, 2)
    try:
        compiles = []
        alone, split, modes, _ = adapters_alone_and_split(model, lora_dir, executor, compiles)
    finally:
        executor.shutdown()
    return alone, split, modes, compiles


def test_requests_with_different_loras_share_the_halves_of_one_forward(two_workers, lora_dir):
    alone, split, modes, _ = adapters_alone_and_split(MODEL, lora_dir, two_workers)
    assert modes == ["segmented"] * STEPS  # each rank's hooks find the owners of its half of the rows
    for rid in alone:
        assert (alone[rid] - split[rid]).abs().max() <= 1e-4, rid


def test_compiled_workers_run_each_half_through_the_row_graph_of_its_rows(lora_dir):
    """Under --compile a CFG-parallel step runs compiled (`CompiledDenoiser.split`): each rank's
    half of the rows (3 of 6, padded to the row bucket of 4) through its row graph, segmented
    adapters bound to the half's rows, the halves gathered outside the graph; equal to one
    eager device (`compiled_adapters_split`)."""
    alone, split, modes, compiles = compiled_adapters_split(MODEL, lora_dir, 4)
    assert modes == ["segmented"] * STEPS
    assert [(c.compiled, c.eager) for c in compiles] == [(1, {})] * (2 * STEPS)
    # the segmented adapters' graph compiles when first met, as on one device (`test_compiled`)
    assert [c.recompiles for c in compiles] == [1, 1] + [0] * (2 * STEPS - 2)
    for rid in alone:
        assert (alone[rid] - split[rid]).abs().max() <= 1e-4, rid


def test_the_parallel_pairs_compose_as_the_table_says(two_workers, control_dir, lora_dir):
    """docs/architecture.md, "The compatibility table": each technique a request asks for, in a
    batch of degree 2 (CFG halves) beside the others; every request ends, and every request of
    an exact pair equals its one-device run. (mixed_sizes with parallel is refused:
    `tests/engine/test_compose.py`; --lora-bound and async ControlNets need a server flag.)"""
    from gouache.techniques import EXACT, REFUSED, pair

    rng = np.random.default_rng(1)
    cond, image = (rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(2))
    mask = np.zeros((64, 64), np.float32)
    mask[:32] = 1.0
    asks = {"lora": ({"loras": (("ink", 0.8),)}, {}),
            "controlnet": ({"controlnets": (("edges", b"", 0.8),)}, {"controls": [cond]}),
            "block_cache": ({"block_cache": 0.5}, {}),
            "template": ({"image": b"-", "template_cache": True, "template_id": "shirt"},
                         {"upload": Upload(image, EditMask(mask))}),
            # all STEPS steps, from the upload
            "img2img": ({"image": b"-", "strength": 1.0}, {"upload": Upload(image)})}
    kinds = [(t,) for t in asks] + [("lora", "controlnet"), ()]

    def load():
        out = []
        for i, kind in enumerate(kinds):
            fields = {k: v for t in kind for k, v in asks[t][0].items()}
            inputs = {k: v for t in kind for k, v in asks[t][1].items()}
            out.append((ImageRequest("+".join(kind) or "plain", "a red circle", 64, 64, STEPS, 4.0, seed=i, **fields),
                        inputs))
        return out

    # the split run's driver prepares with the conditioning cache (conditioning with parallel), the other without
    runners = [ModelRunner(load_pipeline(MODEL), lora=LoraConfig(str(lora_dir)),
                           controlnet=ControlNetConfig(str(control_dir)), conditioning_bytes=budget)
               for budget in (0, 64 << 20)]
    alone, _ = steps(runners[0], load())
    split, _ = steps(runners[1], load(), two_workers)
    assert set(split) == set(alone)
    for technique in asks:
        assert pair(technique, "parallel").verdict != REFUSED
        for rid in split:
            if technique in rid.split("+") and all(pair(t, "parallel").verdict == EXACT for t in rid.split("+")):
                assert (alone[rid] - split[rid]).abs().max() <= 1e-4, (technique, rid)
    assert pair("conditioning", "parallel").verdict == EXACT
    assert runners[1].conditioning.take_report().lookups[("text", "hit")] > 0
    assert (alone["plain"] - split["plain"]).abs().max() <= 1e-4
