"""The ControlNet service: ControlNets in their own processes, residuals through shared memory.
Sync mode equals running them in process (and so diffusers' pipelines); async mode uses the last
step's residuals; a dead worker fails the requests that need it, with the reason, and comes
back, while requests without ControlNets go on."""

import os
import signal
import threading
import time

import pytest
import torch

from gouache.config import ControlNetConfig
from gouache.controlnet.model import Base
from gouache.controlnet.service import ControlService
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from tests.controlnet.test_model import image, request, run

pytestmark = pytest.mark.slow

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return "tiny-sd"


@pytest.fixture(scope="module")
def service(pipe, control_dir):
    service = ControlService(2, str(control_dir), Base.of(pipe), 1 << 30, threads=1)
    yield service
    service.shutdown()


def runner(pipe, control_dir, service=None, mode="sync"):
    config = ControlNetConfig(str(control_dir), workers=2 if service else 0, mode=mode,
                              service=service.address if service else None)
    return ModelRunner(pipe, controlnet=config)


def runs(outputs: list) -> dict[str, int]:
    """ControlNet runs by mode over the steps' outputs."""
    out = {}
    for step in outputs:
        for key, n in step.controlnet.runs.items():
            out[key] = out.get(key, 0) + n
    return out


MIX = [((), 1), ((("edges", 1, 1.0),), 2), ((("depth", 2, 0.5), ("edges", 3, 2.0)), 3)]


def mix(size=(64, 64)):
    out = []
    for nets, seed in MIX:
        spec = [(name, image(k, size), scale) for name, k, scale in nets]
        out.append((request(f"r{seed}", spec, size=size, seed=seed), spec))
    return out


def test_sync_service_equals_running_them_in_process(pipe, control_dir, service):
    local = run(runner(pipe, control_dir), mix())
    outputs = []
    remote = run(runner(pipe, control_dir, service), mix(), outputs=outputs)
    for rid in local:
        assert (local[rid] - remote[rid]).abs().max() <= TOL, rid
    assert runs(outputs) == {"sync": 3 * 2}  # edges and depth, every step
    assert sum(n for step in outputs for n in step.controlnet.loads.values()) == 6
    assert service.address.worker_of("edges") in (0, 1)


def test_several_controlnets_on_one_worker_equal_running_them_in_process(pipe, control_dir):
    one = ControlService(1, str(control_dir), Base.of(pipe), 1 << 30, threads=1)  # every ControlNet on worker 0
    try:
        outputs = []
        remote = run(runner(pipe, control_dir, one), mix(), outputs=outputs)
    finally:
        one.shutdown()
    local = run(runner(pipe, control_dir), mix())
    for rid in local:
        assert (local[rid] - remote[rid]).abs().max() <= TOL, rid
    assert runs(outputs) == {"sync": 3 * 2}


def test_async_mode_joins_residuals_one_step_late(pipe, control_dir, service):
    sync = run(runner(pipe, control_dir, service), mix())
    outputs = []
    late = run(runner(pipe, control_dir, service, mode="async"), mix(), outputs=outputs)
    # the first step waits; the last sends nothing for a step after it
    assert runs(outputs) == {"sync": 2, "async": 2}
    assert (late["r1"] - sync["r1"]).abs().max() <= TOL  # no ControlNet: nothing late
    for rid in ("r2", "r3"):
        difference = (late[rid] - sync[rid]).abs().max()
        assert 0 < difference < 0.5 * (sync[rid] - sync["r1"]).abs().max(), rid


def test_one_step_async_is_sync(pipe, control_dir, service):
    from tests.controlnet import test_model as test_controlnet

    steps, test_controlnet.STEPS = test_controlnet.STEPS, 1
    try:
        sync = run(runner(pipe, control_dir, service), mix())
        late = run(runner(pipe, control_dir, service, mode="async"), mix())
    finally:
        test_controlnet.STEPS = steps
    for rid in sync:
        assert (late[rid] - sync[rid]).abs().max() <= TOL, rid


def test_a_dead_worker_fails_its_requests_and_comes_back(pipe, control_dir, service, monkeypatch):
    r = runner(pipe, control_dir, service)
    requests = mix()
    for req, spec in requests:
        r.prepare(req, controls=[img for _, img, _ in spec])
    ids = tuple(req.request_id for req, _ in requests)
    r.execute(Batch(ids))  # connected to both workers
    victim = service.address.worker_of("edges")
    back = threading.Event()  # the restart waits until the step below has run without the worker
    spawn = service._spawn
    monkeypatch.setattr(service, "_spawn", lambda i: back.wait(60) and spawn(i))
    service.kill(victim)
    out = r.execute(Batch(ids))
    back.set()
    assert out.request_ids == ["r1"]  # the request without ControlNets goes on
    assert set(out.failed) == {"r2", "r3"} and "it is being restarted" in out.failed["r2"]
    deadline = time.monotonic() + 60
    while service.restarts < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    for rid in ids:
        r.release(rid)
    for attempt in range(100):  # the restarted worker takes connections once it has loaded
        try:
            again = run(r, mix())
            break
        except AssertionError:
            time.sleep(0.1)
    assert service.restarts == 1
    assert all(torch.isfinite(v).all() for v in again.values())


def wait_for_restart(service, restarts: int) -> None:
    deadline = time.monotonic() + 60
    while service.restarts < restarts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.restarts == restarts


def test_a_dead_worker_fails_only_the_async_requests_whose_controlnets_it_ran(pipe, control_dir, service):
    r = runner(pipe, control_dir, service, mode="async")
    one = [(request("none", seed=1), []), (request("edges", [("edges", image(1), 1.0)], seed=2), None),
           (request("depth", [("depth", image(2), 1.0)], seed=3), None)]
    for req, _ in one:
        r.prepare(req, controls=[image(k) for k in (1, 2)][:len(req.controlnets)] if req.controlnets else [])
    ids = tuple(req.request_id for req, _ in one)
    assert not r.execute(Batch(ids)).failed  # step 0 waits for the residuals (and connects to both workers)
    victim = service.address.worker_of("edges")
    assert service.address.worker_of("depth") != victim
    os.kill(service._procs[victim].pid, signal.SIGSTOP)  # it takes step 1's run but never answers it
    assert not r.execute(Batch(ids)).failed  # step 1 sends the runs for step 2 and goes on
    restarts = service.restarts
    service.kill(victim)
    out = r.execute(Batch(ids))  # step 2 reads them: the victim's never comes
    assert set(out.failed) == {"edges"} and "it is being restarted" in out.failed["edges"]
    assert sorted(out.request_ids) == ["depth", "none"]  # depth with its residuals of step 1
    for rid in ids:
        r.release(rid)
    wait_for_restart(service, restarts + 1)
