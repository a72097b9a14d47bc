"""Issue 32: a replica that dies or hangs fails only what needed it. Calls racing its death, a
replica stopped mid-request (SIGSTOP), a submit to a stopped replica and a shutdown with a dead
and a stopped replica: each ends within a bound instead of waiting forever."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from gouache.config import EngineConfig, ModelConfig, ReplicaConfig, SchedulerConfig
from gouache.errors import GouacheError
from gouache.replicas.calls import Deadlines
from gouache.replicas.front import ReplicaSet
from tests.replicas.test_replicas import MODEL, Front, request

pytestmark = pytest.mark.slow

LONG_STEPS = 400  # outlasts every scenario here: a request that is still denoising when the fault comes


def start_front(deadlines: Deadlines = Deadlines()) -> Front:
    """Two replicas, round-robin: two requests in a row land one on each."""
    config = (ModelConfig(MODEL), EngineConfig(torch_threads=1), SchedulerConfig(), ReplicaConfig(2, "round-robin"))
    return Front(ReplicaSet(*config, deadlines=deadlines))


def stop_for_good(front: Front) -> None:
    """Kill what a failed test left stopped, then close the set."""
    for replica in front.set.replicas:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(replica.process.pid, signal.SIGKILL)
    front.close()


async def start_long_on_each(replicas: ReplicaSet) -> list:
    """One long request on each replica, both denoising; their handles, in replica order."""
    handles = [await replicas.submit(request(f"long{i}", 64, steps=LONG_STEPS)) for i in range(2)]
    placed = {h.request_id: next(r for r in replicas.replicas if h.request_id in r.requests) for h in handles}
    assert sorted(r.index for r in placed.values()) == [0, 1]
    while not all(r.requests[api_id].started for api_id, r in placed.items()):
        await asyncio.sleep(0.05)
    return sorted(handles, key=lambda h: placed[h.request_id].index)


def test_calls_answer_when_a_replica_dies_under_them_and_shutdown_ends_with_a_dead_and_a_stopped_one():
    """A call sent after a replica died but before the front noticed waited in its send forever
    (a PUSH socket whose peer is gone holds it): /v1/status hung, then SIGTERM behind it. Then
    drain and aclose: the dead replica is not waited for, the stopped one only up to the drain's
    and the close's deadlines, then killed; the socket directory is removed all the same."""
    deadlines = Deadlines(drain_margin_s=1.0, close_s=1.0, ping_s=60.0)
    front = start_front(deadlines)
    try:
        async def scenario():
            replicas = front.set
            handles = await start_long_on_each(replicas)
            replicas.replicas[0].process.kill()
            killed = time.monotonic()
            calls = []
            for _ in range(30):  # every 20 ms for 0.6 s: some land between the death and the watcher's notice
                calls += [asyncio.ensure_future(replicas.status()), asyncio.ensure_future(replicas.render_metrics())]
                await asyncio.sleep(0.02)
            done, pending = await asyncio.wait(calls, timeout=5)
            answered_s = time.monotonic() - killed
            status = await asyncio.wait_for(replicas.status(), 5)
            os.kill(replicas.replicas[1].process.pid, signal.SIGSTOP)  # and the other hangs with its request
            start = time.monotonic()
            await replicas.drain(0.5)
            drained_s = time.monotonic() - start
            await replicas.aclose()
            closed_s = time.monotonic() - start
            return len(pending), [c.exception() for c in done], answered_s, status, drained_s, closed_s, handles

        pending, errors, answered_s, status, drained_s, closed_s, _ = front.run(scenario(), timeout=90)
        front.loop.call_soon_threadsafe(front.loop.stop)
        assert pending == 0, f"{pending} of 60 status and metrics calls had no answer 5 s after the kill"
        assert errors == [None] * 60 and answered_s < 5
        assert [r["alive"] for r in status["replicas"]] == [False, True]
        assert status["replicas"][1]["status"] == "ok"
        assert drained_s < 0.5 + deadlines.drain_margin_s + 1
        assert closed_s < drained_s + deadlines.close_s + 5  # the close's deadline, then a kill and a join
        assert [r.process.exitcode for r in front.set.replicas] == [-signal.SIGKILL, -signal.SIGKILL]
        assert not os.path.exists(front.set._dir)
    finally:
        for replica in front.set.replicas:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(replica.process.pid, signal.SIGKILL)


def test_a_hung_replica_is_killed_its_request_fails_and_the_other_serves_on():
    """SIGSTOP: the process lives but answers nothing. The front's pings find it out; the busy
    replica beside it answers them between its steps and is left alone."""
    deadlines = Deadlines(ping_s=0.5, missed_pings=3)
    front = start_front(deadlines)
    try:
        async def scenario():
            replicas = front.set
            handles = await start_long_on_each(replicas)
            hung, busy = replicas.replicas
            os.kill(hung.process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(GouacheError) as failed:
                await asyncio.wait_for(handles[0].images(), 15)
            failed_s = time.monotonic() - stopped
            status = await asyncio.wait_for(replicas.status(), 5)
            after = await asyncio.wait_for((await replicas.submit(request("after", 64))).images(), 60)
            if handles[1].request_id in busy.requests:  # still denoising, as it was
                handles[1].abort()
                unharmed = True
            else:  # it finished meanwhile (a fast machine): with its image, not an error
                unharmed = len(await asyncio.wait_for(handles[1].images(), 5)) == 1
            return failed.value, failed_s, status, after, unharmed, [r.alive for r in replicas.replicas]

        error, failed_s, status, after, unharmed, alive = front.run(scenario(), timeout=120)
        assert error.kind == "worker_failure" and "replica 0 stopped answering" in str(error)
        assert failed_s < 2 * deadlines.ping_s * deadlines.missed_pings + 2
        assert [r["alive"] for r in status["replicas"]] == [False, True] and alive == [False, True]
        assert len(after) == 1 and unharmed  # the busy replica's own request was never harmed
        front.set.replicas[0].process.join(5)
        assert front.set.replicas[0].process.exitcode == -signal.SIGKILL
    finally:
        stop_for_good(front)


def test_a_submit_to_a_stopped_replica_passes_to_the_other_and_is_aborted_there():
    """The submit's deadline passes; the request is served by the other replica, and the stopped
    one, once resumed, drops it (the abort that followed the submit) instead of running it. A
    third request, routed to the resumed replica behind the dropped submit and its abort, shows
    that it got past them: had it kept the first request, that one would be in flight or
    finished there by the time the third one's image is back."""
    deadlines = Deadlines(submit_s=1.0, ping_s=60.0)  # no ping finds it hung: only the submit's deadline acts
    front = start_front(deadlines)
    try:
        async def scenario():
            replicas = front.set
            os.kill(replicas.replicas[0].process.pid, signal.SIGSTOP)
            # round-robin: r0 to the stopped replica (then on to the other), r1 to the other,
            # "behind" to the resumed one
            images = [await asyncio.wait_for((await replicas.submit(request(f"r{i}", 64))).images(), 30)
                      for i in range(2)]
            os.kill(replicas.replicas[0].process.pid, signal.SIGCONT)
            images.append(await asyncio.wait_for((await replicas.submit(request("behind", 64))).images(), 30))
            return images, (await asyncio.wait_for(replicas.status(), 5))["replicas"]

        images, (resumed, other) = front.run(scenario(), timeout=90)
        assert [len(i) for i in images] == [1, 1, 1]
        assert resumed["alive"] and resumed["requests"] == [] and other["requests"] == []
        assert (resumed["finished"], other["finished"]) == (1, 2)  # "behind" there; r0 and r1 here
    finally:
        stop_for_good(front)


def test_a_start_that_fails_midway_leaves_neither_a_process_nor_the_socket_directory():
    """Replica 1 cannot be launched after replica 0 was: replica 0 is stopped and the directory removed."""
    launched = []

    class FailingSecondLaunch(ReplicaSet):
        def _launch(self, index, commands, messages):
            if index == 1:
                raise OSError("no more processes")
            launched.append(super()._launch(index, commands, messages))
            return launched[-1]

    config = (ModelConfig(MODEL), EngineConfig(torch_threads=1), SchedulerConfig(), ReplicaConfig(2))
    replicas = FailingSecondLaunch(*config)
    with pytest.raises(OSError, match="no more processes"):
        asyncio.run(replicas.start())
    try:
        assert launched[0].exitcode is not None
        assert not os.path.exists(replicas._dir)
    finally:
        launched[0].kill()
