"""`fcfs-static`: what diffusers-based servers do (the baseline).

The oldest waiting request picks the shape; up to `max_batch_size` waiting requests of that
shape form one static batch, which runs until every member is done. Nobody joins a running
batch, so a short request that arrives during a long one waits for all of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Policy
from gouache.sched.output import StepPlan


class FcfsStaticPolicy(Policy):
    name = "fcfs-static"

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> StepPlan:
        if running:
            return StepPlan(groups=[[s.request_id for s in running]])
        if not waiting:
            return StepPlan()
        shape = waiting[0].shape
        batch = [s.request_id for s in waiting if s.shape == shape][: self.config.max_batch_size]
        return StepPlan(groups=[batch], admit=batch)
