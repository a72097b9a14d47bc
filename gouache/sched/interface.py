"""The policy interface and the scheduler that applies its plans.

A policy is pure: it reads the waiting and running `RequestState`s and returns a `StepPlan`.
The `Scheduler` owns the states and is the only thing that changes them, so the live engine
and the simulator can drive the same policy objects.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from gouache.config import SchedulerConfig
from gouache.outputs import StepOutput
from gouache.request import RequestState, RequestStatus
from gouache.sched.output import StepPlan


class StepTimePredictor(Protocol):
    """Predicted seconds of one denoising step of a batch, from its latent shapes."""

    def step_time(self, shapes: Sequence[tuple[int, int]], patched: bool) -> float: ...

    def sizes(self, patched: bool) -> set[tuple[int, int]] | None:
        """The (height, width) pixel sizes `step_time` can price; None: any."""


class Policy(ABC):
    """Chooses the requests of the next step. Must not mutate the states it is given."""

    name: str
    mixes_shapes = False  # plans put several latent shapes in one (patched) forward
    needs_predictor = False  # SLO-aware policies plan with predicted step times
    uses_deadlines = False  # plans read requests' deadlines (slo_ms); others would ignore them

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None):
        if self.needs_predictor and predictor is None:
            raise ValueError(f"policy {self.name!r} needs a step-time cost model (see `gouache profile`)")
        self.config = config
        self.predictor = predictor

    @abstractmethod
    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> StepPlan:
        """`waiting` is in arrival order; `running` in admission order."""


def group_by_shape(states: Sequence[RequestState]) -> list[list[str]]:
    """One group per latent shape, in order of first appearance: one forward pass each."""
    groups: dict[tuple[int, int], list[str]] = {}
    for state in states:
        groups.setdefault(state.shape, []).append(state.request_id)
    return list(groups.values())


class Scheduler:
    """Holds request states; asks the policy for a plan each step and applies it."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.waiting: dict[str, RequestState] = {}  # insertion order = arrival order
        self.running: dict[str, RequestState] = {}  # insertion order = admission order

    def add(self, state: RequestState) -> None:
        state.status = RequestStatus.WAITING
        self.waiting[state.request_id] = state

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a request wherever it is; returns its state if it was known."""
        return self.waiting.pop(request_id, None) or self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> list[str]:
        return [*self.waiting, *self.running]

    def unplannable(self, now: float) -> dict[str, str]:
        """The requests the policy fails to plan even alone, with the error each raised.

        For the engine to blame a failed plan on the requests that caused it. Each probe plans
        with a copy of the policy, so a policy's own state (a round in progress) is untouched.
        """
        blamed = {}
        for state in [*self.waiting.values(), *self.running.values()]:
            alone = ([state], []) if state.request_id in self.waiting else ([], [state])
            try:
                copy.deepcopy(self.policy).plan(*alone, now)
            except Exception as error:
                blamed[state.request_id] = f"{type(error).__name__}: {error}"
        return blamed

    def schedule(self, now: float) -> StepPlan:
        """Ask the policy, then apply its plan: dropped requests are forgotten (the caller
        reports them), admitted ones start running."""
        plan = self.policy.plan(list(self.waiting.values()), list(self.running.values()), now)
        for request_id in plan.drop:
            del self.waiting[request_id]
        for request_id in plan.admit:
            state = self.waiting.pop(request_id)
            state.status = RequestStatus.RUNNING
            self.running[request_id] = state
        for request_id in plan.request_ids:
            state = self.running[request_id]
            if state.first_step_time is None:
                state.first_step_time = now
        return plan

    def update(self, plan: StepPlan, output: StepOutput) -> list[RequestState]:
        """Advance the requests that stepped; return (and forget) those that finished."""
        finished = []
        for request_id in output.request_ids:
            state = self.running.get(request_id)
            if state is None:  # aborted while its step ran
                continue
            state.steps_done += 1
            if state.done:
                state.status = RequestStatus.POSTPROCESSING
                finished.append(self.running.pop(request_id))
        return finished
