"""The multiproc executor: worker processes on gloo run round-knapsack plans whose degrees
change between rounds, with the pixels of one device, and survive a worker's death."""

import os
import signal
import time

import pytest

from gouache.config import CompileConfig, LoraConfig, SchedulerConfig
from gouache.engine.core import EngineCore
from gouache.executor.base import WorkerDied
from gouache.executor.multiproc import MultiprocExecutor
from gouache.executor.pool import DevicePool
from gouache.executor.worker import WorkerSpec
from gouache.metrics import Metrics
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.interface import Policy
from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sched.plan import Batch, Plan
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler
from tests.lora.random_files import random_loras

MODEL = "tiny-sd3"  # 2 heads: degrees 1 and 2
# Two devices make a 64 px step almost twice as fast: alone, a request takes both (elastic
# scale-up); two requests get one device each.
COST = ParallelCostModel({(64, 64): {1: 0.1, 2: 0.051}})


def request(rid, seed, steps=6):
    return ImageRequest(rid, "a red circle", 64, 64, steps, 4.0, seed)


class Loop:
    """An EngineCore on a device pool, driven by hand; keeps final latents, failures, degrees."""

    def __init__(self, executor=None, round_s=0.15, model=MODEL, cost=COST):
        self.runner = ModelRunner(load_pipeline(model))
        self.pool = DevicePool(self.runner, executor) if executor else DevicePool.in_process(self.runner)
        policy = make_policy(SchedulerConfig(policy="round-knapsack", round_s=round_s), cost)
        self.scheduler = Scheduler(policy, self.pool.num_devices)
        self.latents, self.failed, self.degrees = {}, {}, {}
        self.metrics = Metrics()
        self.core = EngineCore(self.pool, self.scheduler, self.metrics, self.on_step,
                               lambda reasons, invalid: self.failed.update(reasons),
                               pytest.fail, lambda error: pytest.fail(str(error)))

    def on_step(self, report):
        for rid in report.output.request_ids:
            self.degrees.setdefault(rid, []).append(report.batch.degree)
        for state in report.finished:
            self.latents[state.request_id] = self.runner.states[state.request_id].latents.clone()
            self.pool.release(state.request_id)

    def add(self, r):
        self.scheduler.add(self.runner.prepare(r))

    def run(self, later=(), after_steps=2, timeout_s=120):
        """Step until idle; `later` requests join once `after_steps` steps have been reported."""
        reports, deadline = 0, time.monotonic() + timeout_s
        while self.scheduler.has_work() or later:
            if later and reports >= after_steps:
                for r in later:
                    self.add(r)
                later = ()
            reports += self.core.step() is not None
            assert time.monotonic() < deadline, "the loop stalled"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return random_loras(tmp_path_factory.mktemp("loras"), MODEL)


@pytest.fixture(scope="module")
def two_workers(lora_dir):
    executor = MultiprocExecutor(WorkerSpec(MODEL, torch_threads=1, lora=LoraConfig(str(lora_dir))), 2)
    yield executor
    executor.shutdown()


def assert_equal_latents(got, expected):
    assert set(got) == set(expected)
    for rid in got:
        assert (got[rid] - expected[rid]).abs().max() <= 1e-4, rid
        assert got[rid].abs().mean() > 0.1  # non-trivial latents


@pytest.mark.slow
def test_round_knapsack_on_two_workers_equals_one_device(two_workers):
    first, second = request("first", seed=1), request("second", seed=2, steps=4)
    pooled, alone = Loop(two_workers), Loop()
    for loop in (pooled, alone):
        loop.add(first)
        loop.run(later=[second])
    assert not pooled.failed
    assert_equal_latents(pooled.latents, alone.latents)
    assert pooled.degrees["first"][0] == 2  # alone, it took both devices (elastic scale-up)


class Script(Policy):
    """A round policy that plays fixed placements, one step a round, cycling: a on both
    devices; a and b one each; swapped (both hand off); both on both devices, one after the
    other."""

    name, rounds, max_devices = "script", True, None
    ROUNDS = [{"a": (0, 1)}, {"a": (0,), "b": (1,)}, {"a": (1,), "b": (0,)}, {"a": (0, 1), "b": (0, 1)}]

    def __init__(self):
        super().__init__(SchedulerConfig())
        self.count = 0

    def plan(self, waiting, running, now, devices):
        present = {s.request_id for s in [*running, *waiting]}
        script = self.ROUNDS[self.count % len(self.ROUNDS)]
        self.count += 1
        batches = [Batch((rid,), block) for rid, block in script.items() if rid in present]
        admit = [s.request_id for s in waiting if s.request_id in script]
        return Plan(batches=batches, admit=admit, until=now)


def check_scripted_rounds(executor) -> Loop:
    """Two requests through `Script`'s placements on 2 devices of `executor`: the latents of one
    device, the scripted degrees, 9 hand-offs, image steps counted by degree. Returns the loop."""
    a, b = request("a", seed=5, steps=7), request("b", seed=6, steps=5)
    pooled, alone = Loop(executor), Loop()
    pooled.scheduler = pooled.core.scheduler = Scheduler(Script(), 2)
    for loop in (pooled, alone):
        loop.add(a)
        loop.add(b)
        loop.run()
    assert not pooled.failed
    assert_equal_latents(pooled.latents, alone.latents)
    assert pooled.degrees == {"a": [2, 1, 1, 2, 2, 1, 1], "b": [1, 1, 2, 1, 1]}
    # rounds 0-6; a: (0,1) (0,) (1,) (0,1) (0,1) (0,) (1,), 5 moves; b from round 1: (1,) (0,) (0,1) - (1,) (0,), 4
    assert pooled.pool.handoffs == 9
    steps = {k: pooled.metrics.image_steps.labels(str(k))._value.get() for k in (1, 2)}
    assert steps == {1: 8, 2: 4}  # /metrics counts image steps by degree
    return pooled


def check_a_dead_worker(executor) -> None:
    """Kill device 1 of `executor` while a request holds its latents there: that request fails
    with the reason, the rank stays dead, and the next request is served on device 0."""
    loop = Loop(executor)
    loop.add(request("doomed", seed=3, steps=50))
    loop.core.step()  # a step on both devices: the request holds its latents there
    executor.kill(1)
    loop.run()
    assert set(loop.failed) == {"doomed"} and "device 1 died" in loop.failed["doomed"]
    assert executor.dead() == {1} and loop.scheduler.lost == {1}
    with pytest.raises(WorkerDied, match="device 1"):
        executor.collective_rpc("ping", ranks=[1])
    loop.add(request("next", seed=4, steps=3))
    loop.run()
    assert "next" in loop.latents and set(loop.degrees["next"]) == {1}


@pytest.mark.slow
def test_degrees_change_between_rounds_and_latents_follow_their_requests(two_workers):
    check_scripted_rounds(two_workers)


@pytest.mark.slow
def test_compiled_workers_equal_one_eager_device_with_split_steps_in_pieces():
    """Workers that compile (warmed up before they serve, the pieces of their Ulysses shards
    too): the scripted rounds' latents equal one eager device's, and every step ran compiled,
    those on both devices in the pieces (`gouache.runner.pieces.Shard`), none compiling a graph."""
    spec = WorkerSpec(MODEL, torch_threads=1, compile=CompileConfig(enabled=True, buckets=(2,), sizes=((64, 64),)))
    executor = MultiprocExecutor(spec, 2)
    try:
        pooled = check_scripted_rounds(executor)
    finally:
        executor.shutdown()
    steps = {(s.labels["path"], s.labels["reason"]): s.value for s in pooled.metrics.compile_steps.collect()[0].samples
             if s.name.endswith("_total")}
    assert steps == {("compiled", ""): 12}
    assert pooled.metrics.compile_recompiles._value.get() == 0


@pytest.mark.slow
def test_a_dead_worker_fails_its_requests_and_the_rest_are_served():
    executor = MultiprocExecutor(WorkerSpec(MODEL, torch_threads=1), 2)
    try:
        check_a_dead_worker(executor)
    finally:
        executor.shutdown()


# One device only: two requests run side by side, one on each device, with no collective.
ONE_DEVICE_COST = ParallelCostModel({(64, 64): {1: 0.1}})


def check_a_hung_worker(executor, deadline_s: float, pid: int) -> None:
    """Stop device 1's worker (process `pid`: alive, answering nothing) while each of two requests
    runs on one device: within the deadline it is taken for dead, killed, and its request fails
    saying so; the other request finishes, and the next is served on device 0."""
    loop = Loop(executor, cost=ONE_DEVICE_COST)
    loop.add(request("left", seed=3, steps=12))
    loop.add(request("right", seed=4, steps=12))
    loop.core.step()
    assert {rid: s.devices for rid, s in loop.scheduler.running.items()} == {"left": (0,), "right": (1,)}
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    loop.run(timeout_s=deadline_s + 60)
    assert time.monotonic() - stopped < deadline_s + 30
    assert list(loop.failed) == ["right"] and set(loop.latents) == {"left"}
    assert "device 1" in loop.failed["right"] and f"answered nothing for {deadline_s:g} s" in loop.failed["right"]
    assert executor.dead() == {1}
    loop.add(request("next", seed=5, steps=3))
    loop.run()
    assert "next" in loop.latents and set(loop.degrees["next"]) == {1}


def check_a_worker_hung_in_a_collective(executor, deadline_s: float, pid: int) -> None:
    """Stop device 1's worker while a request runs on both devices: device 0's worker waits in the
    step's collective, gives up at the collective timeout (so it is not taken for hung too), the
    request fails, device 1's worker is killed at its deadline, and the next request is served
    on device 0."""
    loop = Loop(executor)
    loop.add(request("doomed", seed=3, steps=50))
    loop.core.step()
    assert loop.scheduler.running["doomed"].devices == (0, 1)  # alone, it takes both (elastic scale-up)
    os.kill(pid, signal.SIGSTOP)
    loop.run(timeout_s=deadline_s + 60)
    assert list(loop.failed) == ["doomed"]
    wait_until = time.monotonic() + deadline_s + 30
    while executor.dead() != {1}:  # until then, a step on both would wait for the hung worker too
        assert time.monotonic() < wait_until and not executor.dead() - {1}, executor.dead()
        time.sleep(0.1)
    loop.add(request("next", seed=5, steps=3))
    loop.run()
    assert "next" in loop.latents and set(loop.degrees["next"]) == {1} and loop.scheduler.lost == {1}


@pytest.mark.slow
@pytest.mark.parametrize("check", [check_a_hung_worker, check_a_worker_hung_in_a_collective])
def test_a_hung_worker_is_taken_for_dead_at_its_deadline_and_the_rest_are_served(check):
    """Before: a worker that stopped answering (alive, stuck) held its step forever; the round
    never ended and nothing else ran. Its collective peer waited 30 min (a block's process
    group had torch's default timeout, not the collective timeout)."""
    deadline_s = 5.0  # a tiny model's step takes milliseconds: seconds are ample, even under CI's load
    executor = MultiprocExecutor(WorkerSpec(MODEL, torch_threads=1), 2, collective_timeout_s=3.0,
                                 reply_deadline_s=deadline_s)
    try:
        check(executor, deadline_s, executor._procs[1].pid)
        assert executor._procs[0].is_alive()
    finally:
        executor.shutdown()


def test_a_reply_deadline_within_the_collective_timeout_is_refused():
    with pytest.raises(ValueError, match="reply deadline .* must exceed the collective timeout"):
        MultiprocExecutor(WorkerSpec(MODEL), 2, collective_timeout_s=60.0, reply_deadline_s=30.0)


@pytest.mark.slow
def test_a_worker_that_dies_while_idle_is_lost_before_the_next_plan_uses_it():
    """Before: the engine learned of the death only when a step failed on it, so the next request
    (alone: on both devices) failed although device 0 could serve it."""
    executor = MultiprocExecutor(WorkerSpec(MODEL, torch_threads=1), 2)
    try:
        loop = Loop(executor)
        loop.add(request("first", seed=3, steps=2))
        loop.run()
        executor.kill(1)
        executor._procs[1].join(10)
        while executor.dead() != {1}:  # the reader thread sees the pipe close
            time.sleep(0.05)
        loop.add(request("next", seed=4, steps=3))
        loop.run()
        assert not loop.failed and set(loop.latents) == {"first", "next"}
        assert loop.degrees["first"][0] == 2 and set(loop.degrees["next"]) == {1} and loop.scheduler.lost == {1}
    finally:
        executor.shutdown()


@pytest.mark.slow
def test_profile_measures_degrees_and_the_handoff_for_the_simulator(tmp_path):
    from gouache.cli import main
    from gouache.sched.costmodel import load
    from gouache.sim.costs import load_handoff

    out = tmp_path / "parallel.json"
    assert main(["profile", "--model", MODEL, "--devices", "2", "--sizes", "64,96", "--repeats", "2",
                 "--torch-threads", "1", "--out", str(out)]) == 0
    model, handoff = load(out), load_handoff(out)
    assert model.kind == "parallel" and model.resolutions == [(64, 64), (96, 96)]
    assert all(model.degrees(res) == [1, 2] and model.seconds(res, 2) > 0 for res in model.resolutions)
    assert handoff.fixed_s >= 0 and handoff.per_megapixel_s >= 0 and "--devices 2" in handoff.source
    assert main(["simulate", "--policies", "round-knapsack,fixed-sp-2", "--devices", "2", "--cost-model", str(out),
                 "--sizes", "64,96", "--requests", "10", "--rate", "2", "--steps", "5"]) == 0


@pytest.mark.slow
def test_clips_step_sequence_parallel_on_two_workers_equal_to_one_device_at_their_profiled_degrees(tmp_path):
    from gouache.cli import main
    from gouache.sched.costmodel import load

    out = tmp_path / "parallel.json"
    assert main(["profile", "--model", "tiny-wan", "--devices", "2", "--sizes", "32x32x5,48x32x9", "--repeats", "1",
                 "--torch-threads", "1", "--out", str(out)]) == 0
    profiled = load(out)
    assert profiled.resolutions == [(32, 32, 5), (32, 48, 9)] and profiled.degrees((32, 48, 9)) == [1, 2]
    clips = [ImageRequest("long", "a red fox", 48, 32, 5, 4.0, 1, num_frames=9),
             ImageRequest("short", "a blue sky", 32, 32, 3, 4.0, 2, num_frames=5)]
    cost = ParallelCostModel({(32, 32, 5): {1: 0.1, 2: 0.051}, (32, 48, 9): {1: 0.2, 2: 0.1}})
    executor = MultiprocExecutor(WorkerSpec("tiny-wan", torch_threads=1), 2)
    try:
        pooled, alone = Loop(executor, model="tiny-wan", cost=cost), Loop(model="tiny-wan", cost=cost)
        for loop in (pooled, alone):
            loop.add(clips[0])
            loop.run(later=[clips[1]])
    finally:
        executor.shutdown()
    assert not pooled.failed
    assert_equal_latents(pooled.latents, alone.latents)
    assert pooled.degrees["long"][0] == 2  # alone, it took both devices


@pytest.mark.slow
def test_bench_parallel_reports_executor_overhead_collectives_and_handoffs(tmp_path):
    import json

    from gouache.cli import main

    out = tmp_path / "parallel.json"
    assert main(["bench", "parallel", "--model", MODEL, "--devices", "2", "--sizes", "64", "--repeats", "2",
                 "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["uniproc_k1_ms"] > 0 and row["multiproc_k1_ms"] > 0
    assert 0 < row["k2_collectives_ms"] < row["k2_step_ms"]  # the all-to-alls are timed, inside the step
    assert "handoff_ms" in row and out.with_suffix(".md").exists()


@pytest.mark.parametrize("model, policy, devices, cost, message", [
    ("tiny-sd", "fixed-sp-4", 4, None, "UNet, which runs at degree 1, or 2 with CFG parallelism"),
    ("tiny-sd3", "fixed-sp-4", 4, None, "do not divide by degree 4"),
    ("tiny-sd3", "round-knapsack", 4, {(64, 64): {1: 0.1, 4: 0.03}}, "do not divide by degree 4"),
])
def test_a_degree_the_model_cannot_run_is_refused_before_any_worker_starts(tmp_path, model, policy, devices, cost,
                                                                           message):
    from gouache.config import EngineConfig, ModelConfig
    from gouache.engine.build import build_engine
    from gouache.sched.costmodel import save

    path = None
    if cost:
        path = tmp_path / "parallel.json"
        save(ParallelCostModel(cost), path)
    config = SchedulerConfig(policy=policy, cost_model=str(path) if path else None)
    with pytest.raises(ValueError, match=message):
        build_engine(ModelConfig(model), EngineConfig(executor="multiproc", devices=devices), config)


def test_round_knapsack_plans_only_the_degrees_its_cost_model_prices():
    policy = make_policy(SchedulerConfig(policy="round-knapsack"), COST)
    assert policy.degrees(4) == {1, 2} and make_policy(SchedulerConfig(policy="fixed-sp-2")).degrees(4) == {2}


@pytest.mark.slow
def test_requests_with_different_loras_share_a_sequence_parallel_forward(two_workers, lora_dir):
    """docs/architecture.md, "The compatibility table": lora with parallel is exact under
    Ulysses too (a DiT's batch of degree 2; the CFG halves are in tests/parallel/test_cfg.py)."""
    from tests.parallel.test_cfg import STEPS, adapters_alone_and_split

    alone, split, modes, collectives = adapters_alone_and_split(MODEL, lora_dir, two_workers)
    assert modes == ["segmented"] * STEPS and all(seconds > 0 for seconds in collectives)
    assert_equal_latents(split, alone)


@pytest.mark.slow
def test_a_parked_state_lives_in_its_workers_host_memory_and_moves_on_with_a_handoff(two_workers):
    """A paused request parked on device 0's worker (pickled there, off its device), then run
    on device 1: the hand-off carries the parked state, worker 1 restores it, and the request
    ends as it would have on one device."""
    alone = Loop()
    alone.add(request("a", seed=7, steps=4))
    alone.run()
    runner = ModelRunner(load_pipeline(MODEL))
    pool = DevicePool(runner, two_workers, park_bytes=1 << 30)
    runner.prepare(request("a", seed=7, steps=4))
    pool.submit(Batch(("a",), (0,))).result()
    pool.park(["a"])
    two_workers.collective_rpc("ping", ranks=[0])  # a worker answers in order: the park is done
    assert pool.parked["a"] > runner.states["a"].nbytes() > 0  # its parked copy, sampler and all
    for _ in range(3):
        pool.submit(Batch(("a",), (1,))).result()
    assert pool.handoffs == 1 and not pool.parked
    assert_equal_latents({"a": runner.states["a"].latents}, alone.latents)
    pool.release("a")
