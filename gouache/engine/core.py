"""The engine loop of one replica: schedule -> execute one denoising step of a ready run -> advance.

The scheduler hands out plans of batches (runs); with one device they run one after the
other, a step at a time, so aborts and new arrivals are seen between any two steps. Runs in
its own thread. Everything else (text encoding, VAE, image codecs) happens in the
stages, so a step is never held up by them. Other threads talk to the loop only through
its inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gouache.metrics import Metrics
from gouache.outputs import StepOutput
from gouache.request import RequestState
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.sched.scheduler import Run, Scheduler

log = logging.getLogger(__name__)


@dataclass
class StepReport:
    """What one step did, for the engine's listeners (events, metrics)."""

    batch: Batch  # the batch the step belonged to, with the members that stepped
    output: StepOutput
    finished: list[RequestState]  # done denoising; their states are still in the runner
    states: dict[str, RequestState]  # every request that stepped, by id


class EngineCore:
    """The loop. No request can stop it: a step or a plan that fails fails the requests it
    concerns and the loop goes on. Should the loop itself die (a bug), `on_death` is told."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, metrics: Metrics,
                 on_step: Callable[[StepReport], None], on_failure: Callable[[dict[str, str]], None],
                 on_drop: Callable[[list[str]], None], on_death: Callable[[BaseException], None]):
        self.runner = runner
        self.scheduler = scheduler
        self.metrics = metrics
        self.on_step = on_step  # called in the loop thread after every step
        self.on_failure = on_failure  # called with {request id: why} of requests that failed and were forgotten
        self.on_drop = on_drop  # called with the ids the policy dropped (deadline unattainable)
        self.on_death = on_death  # called in the loop thread if the loop itself raises
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gouache-engine", daemon=True)

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def add(self, state: RequestState) -> None:
        self.inbox.put(("add", state))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.scheduler.has_work())
                self.step()
        except BaseException as error:  # a bug in the loop: say so; the server exits non-zero
            log.critical("the engine loop died", exc_info=True)
            self._stop.set()  # `running` is False from here on
            self.on_death(error)

    def step(self) -> StepReport | None:
        """One denoising step of the first ready run, planning first if none is ready."""
        start = time.perf_counter()
        run = self._next_run(time.monotonic())
        if run is None:
            return None
        ids = self.scheduler.members(run, time.monotonic())
        batch = replace(run.batch, request_ids=tuple(ids))
        states = {rid: self.scheduler.running[rid] for rid in ids}
        try:
            output = self.runner.execute(batch)
        except Exception as error:  # outside any one request's work: the step's requests fail
            log.exception("denoising step failed")
            self.scheduler.end(run)
            self._fail({rid: f"denoising failed: {error}" for rid in ids})
            return None
        self._fail(output.failed)
        finished = self.scheduler.advance(run, output.request_ids, time.monotonic()).finished
        report = StepReport(batch, output, finished, states)
        self.on_step(report)
        step_s = time.perf_counter() - start
        self.metrics.step_latency.observe(step_s)
        # everything but the model: scheduling, batching, update, event hand-off
        self.metrics.step_overhead.observe(step_s - output.forward_s)
        return report

    def _next_run(self, now: float) -> Run | None:
        """The run to step next: the first ready one with members left, after planning when
        the scheduler has something to decide; None if nothing can step now."""
        while True:
            for run in self.scheduler.ready():
                if self.scheduler.members(run, now):
                    return run
                self.scheduler.end(run)  # every member finished, failed or was aborted
            if not self._schedule(now):
                return None

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
        if plan.drop:
            for rid in plan.drop:
                self.runner.release(rid)
            self.on_drop(plan.drop)
        return bool(plan)

    def _fail(self, reasons: dict[str, str]) -> None:
        for rid in reasons:
            self.scheduler.abort(rid)
            self.runner.release(rid)
        if reasons:
            self.on_failure(reasons)

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
                self.runner.release(payload)
