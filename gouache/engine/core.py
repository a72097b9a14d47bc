"""The engine loop of one replica: schedule -> execute one denoising step -> update.

Runs in its own thread. Everything else (text encoding, VAE, image codecs) happens in the
stages, so a step is never held up by them. Other threads talk to the loop only through
its inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gouache.metrics import Metrics
from gouache.outputs import StepOutput
from gouache.request import RequestState
from gouache.runner.model_runner import ModelRunner
from gouache.sched.interface import Scheduler
from gouache.sched.output import StepPlan

log = logging.getLogger(__name__)


@dataclass
class StepReport:
    """What one step did, for the engine's listeners (events, metrics)."""

    plan: StepPlan
    output: StepOutput
    finished: list[RequestState]  # done denoising; their states are still in the runner
    states: dict[str, RequestState]  # every request that stepped, by id


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, metrics: Metrics,
                 on_step: Callable[[StepReport], None], on_failure: Callable[[list[str], Exception], None],
                 on_drop: Callable[[list[str]], None]):
        self.runner = runner
        self.scheduler = scheduler
        self.metrics = metrics
        self.on_step = on_step  # called in the loop thread after every step
        self.on_failure = on_failure  # called with the ids of a step that raised
        self.on_drop = on_drop  # called with the ids the policy dropped (deadline unattainable)
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
        while not self._stop.is_set():
            self._drain_inbox(block=not self.scheduler.has_work())
            self.step()

    def step(self) -> StepReport | None:
        start = time.perf_counter()
        plan = self.scheduler.schedule(time.monotonic())
        if plan.drop:
            for rid in plan.drop:
                self.runner.release(rid)
            self.on_drop(plan.drop)
        if not plan.groups:
            return None
        states = {rid: self.scheduler.running[rid] for rid in plan.request_ids}
        try:
            output = self.runner.execute(plan)
        except Exception as error:  # a failing step fails its requests, never the loop
            log.exception("denoising step failed")
            for rid in plan.request_ids:
                self.scheduler.abort(rid)
            self.on_failure(plan.request_ids, error)
            return None
        finished = self.scheduler.update(plan, output)
        report = StepReport(plan, output, finished, states)
        self.on_step(report)
        step_s = time.perf_counter() - start
        self.metrics.step_latency.observe(step_s)
        # everything but the model: scheduling, batching, update, event hand-off
        self.metrics.step_overhead.observe(step_s - output.forward_s)
        return report

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
