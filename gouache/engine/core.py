"""The engine loop of one replica: schedule -> launch a step of every ready run -> advance each as it ends.

The scheduler hands out plans of batches (runs) on device blocks. The loop launches one
denoising step of every ready run on its devices (`DevicePool.submit`: runs on disjoint blocks
step at once), and as each step ends it advances that run and launches its next step, so aborts
and new arrivals are seen between any two steps of a run. With one in-process device a step
runs inside `submit`. Runs in its own thread. Everything else (text encoding, VAE, image
codecs) happens in the stages, so a step is never held up by them. Other threads talk to the
loop only through its inbox.

A device whose worker dies (or hangs past its executor's deadline, which kills it) is lost for
good: the requests running on it or holding their state there fail with an explicit error, and
the pool plans on the devices left. When the policy cannot plan on those (none left, or no
aligned block of k for fixed-sp-k) the engine stops, as it would on a bug, so that the server
fails what waits with the reason and reports itself dead instead of holding requests forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace

from gouache.executor.base import WorkerDied
from gouache.executor.pool import DevicePool
from gouache.metrics import Metrics
from gouache.outputs import CacheBytes, StepOutput
from gouache.request import RequestState
from gouache.sched.plan import Batch, Plan
from gouache.sched.scheduler import Run, Scheduler
from gouache.threads import own

log = logging.getLogger(__name__)


class PoolLost(RuntimeError):
    """The devices left cannot run the policy: the engine stops."""


@dataclass
class StepReport:
    """What one step did, for the engine's listeners (events, metrics)."""

    batch: Batch  # the batch the step belonged to, with the members that stepped
    output: StepOutput
    finished: list[RequestState]  # done denoising; their states are still in the pool
    states: dict[str, RequestState]  # every request that stepped, by id
    step_s: float = 0.0  # wall time of the step, launch to result


@dataclass
class _Flight:
    """A step of a run launched on its devices."""

    run: Run
    batch: Batch  # the members that were launched
    states: dict[str, RequestState]
    future: Future
    start: float  # perf_counter at launch


class EngineCore:
    """The loop. No request can stop it: a step or a plan that fails fails the requests it
    concerns and the loop goes on. Should the loop itself die (a bug), `on_death` is told."""

    def __init__(self, pool: DevicePool, scheduler: Scheduler, metrics: Metrics,
                 on_step: Callable[[StepReport], None], on_failure: Callable[[dict[str, str], dict[str, str]], None],
                 on_plan: Callable[[Plan], None], on_death: Callable[[BaseException], None],
                 threads: int | None = None):
        """`threads`: the intra-op threads the loop thread runs torch on, where it runs the steps
        (`gouache.threads`; None: the count it starts with)."""
        self.pool = pool
        self.threads = threads
        self.scheduler = scheduler
        self.metrics = metrics
        self.on_step = on_step  # called in the loop thread after every step
        # called with {request id: why} of requests that failed and were forgotten, and {request id:
        # the request field at fault} of those whose own input failed them (StepOutput.invalid)
        self.on_failure = on_failure
        self.on_plan = on_plan  # called with a plan that drops (deadline unattainable) or pauses requests
        self.on_death = on_death  # called in the loop thread if the loop itself raises
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._flights: list[_Flight] = []
        self._stop = threading.Event()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # `call`s before the loop; None: the loop begins
        self._thread = threading.Thread(target=self._run, name="gouache-engine", daemon=True)

    # -- called from other threads ---------------------------------------------------------

    def call(self, fn: Callable[[], object]) -> object:
        """`fn()` run on the loop's thread before the loop begins; its result, or its error
        raised here. A compiled model warms up so: torch keeps a thread's CUDA graphs and
        dynamo settings to that thread, so the thread that steps must be the one that warmed up
        (else it records every graph again, in a second memory pool)."""
        if not self._thread.is_alive():
            self._thread.start()
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result()

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()
        self._calls.put(None)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self._calls.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def add(self, state: RequestState) -> None:
        self.inbox.put(("add", state))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads is not None:
            own(self.threads)
        while (call := self._calls.get()) is not None:  # `call`s, until the loop begins
            fn, future = call
            try:
                future.set_result(fn())
            except BaseException as error:  # the caller's to raise
                future.set_exception(error)
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.scheduler.has_work())
                self.step()
                if not self._flights and not self.scheduler.has_work():  # idle: caches say what they hold
                    self.pool.settle(self._cache_held)
        except PoolLost as error:  # not a bug: the workers it needs are gone; the server exits non-zero
            log.critical("the engine stops: %s", error)
            self._die(error)
        except BaseException as error:  # a bug in the loop: say so; the server exits non-zero
            log.critical("the engine loop died", exc_info=True)
            self._die(error)

    def _die(self, error: BaseException) -> None:
        self._stop.set()  # `running` is False from here on
        self.on_death(error)

    def step(self, wait_s: float = 0.05) -> StepReport | None:
        """Launch a step of every ready run not stepping (planning when the scheduler has
        something to decide), then finish one step that has ended, waiting up to `wait_s`
        seconds for one; None if none ended (or none was launched)."""
        self._lose_idle_workers()
        self._launch(time.monotonic())
        if not self._flights:
            return None
        ended = [f for f in self._flights if f.future.done()]
        if not ended:
            wait([f.future for f in self._flights], timeout=wait_s, return_when=FIRST_COMPLETED)
            ended = [f for f in self._flights if f.future.done()]
        return self._finish(ended[0]) if ended else None

    def _launch(self, now: float) -> None:
        """Start a step of each ready run that is not stepping; plan again while a plan gives
        runs or drops."""
        while True:
            stepping = {id(f.run) for f in self._flights}
            for run in self.scheduler.ready():
                if id(run) in stepping:
                    continue
                ids = self.scheduler.members(run, now)
                if not ids:
                    self.scheduler.end(run)  # every member finished, failed or was aborted
                    continue
                batch = replace(run.batch, request_ids=tuple(ids))
                states = {rid: self.scheduler.running[rid] for rid in ids}
                start = time.perf_counter()
                try:
                    future = self.pool.submit(batch)
                except Exception as error:
                    future = Future()
                    future.set_exception(error)
                self._flights.append(_Flight(run, batch, states, future, start))
            if not self._schedule(now):
                return

    def _finish(self, flight: _Flight) -> StepReport | None:
        self._flights.remove(flight)
        run, ids = flight.run, list(flight.batch.request_ids)
        try:
            output = flight.future.result()
        except WorkerDied as error:
            if run in self.scheduler.runs:
                self.scheduler.end(run)
            self._lose(self.pool.dead() - self.scheduler.lost, dict.fromkeys(ids, str(error)), str(error))
            return None
        except Exception as error:  # outside any one request's work: the step's requests fail
            log.error("denoising step failed: %s", error)
            self.scheduler.end(run)
            self._fail({rid: f"denoising failed: {error}" for rid in ids})
            return None
        self._fail(output.failed, output.invalid)
        finished = self.scheduler.advance(run, output.request_ids, time.monotonic()).finished
        step_s = time.perf_counter() - flight.start
        report = StepReport(flight.batch, output, finished, flight.states, step_s)
        self.on_step(report)
        self.metrics.image_steps.labels(str(flight.batch.degree)).inc(len(output.request_ids))
        output.record(self.metrics, str(flight.batch.devices[0]))
        self.metrics.step_latency.observe(step_s)
        self.metrics.paused_host_bytes.set(self.pool.parked_bytes)
        # everything but the model: scheduling, batching, update, event hand-off
        self.metrics.step_overhead.observe(step_s - output.forward_s)
        return report

    def _cache_held(self, device: int, held: CacheBytes) -> None:
        """What a device's caches hold, reported while the engine is idle."""
        held.record(self.metrics, str(device))

    def _lose_idle_workers(self) -> None:
        """Lose the devices whose workers died with no step of theirs in flight, before a plan
        can use them; a device that is stepping is lost when its step fails, with its worker's
        own reason."""
        stepping = {d for f in self._flights for d in f.batch.devices}
        dead = self.pool.dead() - self.scheduler.lost - stepping
        if dead:
            self._lose(dead, {}, "; ".join(str(WorkerDied(d)) for d in sorted(dead)))

    def _lose(self, dead: set[int], failed: dict[str, str], why: str) -> None:
        """Devices `dead` are lost for good (`why`: their workers died). The requests of a step
        that failed with them (`failed`: id -> reason) and those whose state was there fail;
        raises `PoolLost` if the policy cannot plan on the devices left."""
        reasons = dict(failed)
        for state in self.scheduler.lose(dead):
            reasons.setdefault(state.request_id, f"its latents were on a device that died ({why})")
        for rid in self.pool.stranded(dead):
            reasons.setdefault(rid, f"its latents were on a device that died ({why})")
        self._fail(reasons)
        if not self.scheduler.can_serve():
            policy, lost = self.scheduler.policy, sorted(self.scheduler.lost)
            left = ", ".join(map(str, self.scheduler.live().free)) or "none"
            raise PoolLost(f"policy {policy.name!r} cannot run without device{'s' * (len(lost) > 1)} "
                           f"{', '.join(map(str, lost))}: it needs {policy.needs(self.scheduler.num_devices)}, "
                           f"and the devices left are {left} ({why})")

    def _schedule(self, now: float) -> bool:
        """Ask for a plan, reporting dropped requests; whether it gave runs or drops (so the
        caller looks again). On a failed plan, fail the requests the policy cannot plan (all
        of them if no one alone is to blame)."""
        try:
            plan = self.scheduler.schedule(now)
        except Exception as error:
            log.exception("planning failed")
            blamed = self.scheduler.unplannable(now)
            if not blamed:
                blamed = {rid: f"{type(error).__name__}: {error}" for rid in self.scheduler.request_ids()}
            self._fail({rid: f"the scheduler could not plan it: {why}" for rid, why in blamed.items()})
            return bool(blamed)
        for rid in plan.drop:
            self.pool.release(rid)
        if plan.pause:
            self.pool.park(plan.pause)  # under --paused-host-mb: their states to host memory
        if plan.drop or plan.pause:
            self.on_plan(plan)
        return bool(plan)

    def _fail(self, reasons: dict[str, str], invalid: dict[str, str] | None = None) -> None:
        for rid in reasons:
            self.scheduler.abort(rid)
            self.pool.release(rid)
        if reasons:
            self.on_failure(reasons, invalid or {})

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                self._apply(*command)
                command = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, kind: str, payload) -> None:
        if kind == "add":
            self.scheduler.add(payload)
        elif kind == "abort":
            if self.scheduler.abort(payload) is not None:
                self.pool.release(payload)
