"""Hand-made request states for policy tests, and a driver that runs plans as the engine does."""

from __future__ import annotations

from gouache.request import RequestState
from gouache.sched.plan import Plan


def make_state(rid: str, resolution=(256, 256), steps: int = 4, arrival: float = 0.0) -> RequestState:
    return RequestState(request_id=rid, resolution=resolution, num_steps=steps, arrival_time=arrival)


def groups(plan: Plan) -> list[list[str]]:
    """The plan's batches as lists of ids, in order."""
    return [list(batch.request_ids) for batch in plan.batches]


def run_step(scheduler, now: float = 0.0):
    """Plan, then run the plan's batches one step at a time, each to its end, with a runner that
    always succeeds; returns (plan, finished ids)."""
    plan = scheduler.schedule(now)
    finished = []
    while ready := scheduler.ready():
        run = ready[0]
        result = scheduler.advance(run, scheduler.members(run, now), now)
        finished += [s.request_id for s in result.finished]
    return plan, finished
