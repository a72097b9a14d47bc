"""`round-knapsack`: TetriServe's deadline-aware round scheduler (§4.2) as a round policy.

Every τ seconds all unfinished requests, started or not, are replanned by `plan_round`
(knapsack.py): least-device-time deadline plans, Algorithm 1's group knapsack over the urgent
ones, elastic scale-up of the idle devices, optional selective batching, and aligned placement
that keeps last round's devices where the degree is unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from gouache.sched.knapsack import plan_round
from gouache.sched.rounds import RoundPlan, StepTime, cached, max_degree
from gouache.sched.rounds_interface import Placement, RoundPolicy, RoundState


class RoundKnapsackPolicy(RoundPolicy):
    name = "round-knapsack"
    preemptive = True

    def plan(self, waiting: Sequence[RoundState], running: Sequence[RoundState], now: float,
             num_devices: int, previous_placement: Placement | None = None) -> RoundPlan:
        requests = self.round_requests((*running, *waiting))
        return plan_round(
            requests, self.step_time, num_devices, self.config.tau, now, previous_placement,
            batch_step_time=self.batch_step_time, max_batch=self.config.max_batch, run_late=self.config.run_late,
        )


def shortest_round(step_time: StepTime, resolutions: Iterable[Hashable], num_devices: int, steps: int = 1) -> float:
    """τ = steps x the largest T_min(resolution): the shortest round in which every resolution
    completes `steps` steps at its fastest degree. Any shorter and the largest resolution gets
    q = 0 at every degree, so it never runs. At this length that resolution's steps also end
    exactly on round boundaries, the paper's rule of fitting τ to the step times (§4.2.2), for
    the requests that can least afford the idle tail of a round."""
    if steps < 1:
        raise ValueError(f"steps per round must be >= 1, got {steps}")
    table = cached(step_time)
    return steps * max(table.fastest(res, max_degree(num_devices)) for res in resolutions)
