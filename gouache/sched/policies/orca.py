"""`orca`: step-level continuous batching, one forward per latent shape.

Waiting requests join the running set at the next step (FCFS, up to `max_batch_size`); a
finished request leaves at once. Requests of different shapes run in separate forwards of
the same step, as SGLang and vLLM-Omni's step mode do.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Policy, group_by_shape
from gouache.sched.output import StepPlan


class OrcaPolicy(Policy):
    name = "orca"

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> StepPlan:
        free = max(self.config.max_batch_size - len(running), 0)
        admitted = list(waiting[:free])
        return StepPlan(groups=group_by_shape([*running, *admitted]), admit=[s.request_id for s in admitted])
