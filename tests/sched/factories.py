"""Hand-made request states for policy tests."""

from __future__ import annotations

from gouache.outputs import StepOutput
from gouache.request import RequestState


def make_state(rid: str, shape=(32, 32), steps: int = 4, arrival: float = 0.0) -> RequestState:
    return RequestState(request_id=rid, shape=shape, num_steps=steps, arrival_time=arrival)


def run_step(scheduler, now: float = 0.0):
    """One engine step with a runner that always succeeds; returns (plan, finished ids)."""
    plan = scheduler.schedule(now)
    finished = scheduler.update(plan, StepOutput(request_ids=plan.request_ids, forward_s=0.0))
    return plan, [s.request_id for s in finished]
