"""A request's knapsack group for one round (TetriServe §4.2.1 and Algorithm 1, lines 3-12).

Its deadline plan is the least device-time (s^m, A^m) that meets its deadline, mixing at
most two power-of-two degrees (`deadline_allocations`; `minimal_feasible_degree` is the
single-degree case). Its options this round are "none", or one part m of that plan run for
q = min(s^m, floor(τ / T(A^m))) steps on A^m devices, each with its survival sv_i(o)
(`round_options`). Pure Python: no torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Sequence

from gouache.sched.rounds import (
    Allocation,
    DegreeRow,
    RoundOption,
    RoundRequest,
    StepTable,
    StepTime,
    cached,
    degrees,
    max_degree,
    steps_in_round,
    survives,
)

Parts = tuple[tuple[int, int], ...]  # a deadline plan's (steps, degree) parts, ascending degree


def minimal_feasible_degree(
    request: RoundRequest, step_time: StepTime, now: float, max_degree: int
) -> int | None:
    """The power-of-two degree k <= max_degree with which all remaining steps end by the
    deadline (now + s x T(res, k) <= D) at the least device-time k x T(res, k) x s, the smaller
    k on a tie; None if even the fastest degree misses. With sublinear scaling (the paper's
    Fig. 2) this is the smallest feasible k."""
    s, res = request.remaining_steps, request.resolution
    feasible = [
        (k * step_time(res, k), k) for k in degrees(max_degree) if now + s * step_time(res, k) <= request.deadline
    ]
    return min(feasible)[1] if feasible else None


def deadline_allocations(
    request: RoundRequest, step_time: StepTime, now: float, max_degree: int
) -> list[Allocation] | None:
    """TetriServe §4.2.1: min sum_j A_j x T(A_j) subject to sum_j T(A_j) <= D - now, over the remaining steps.

    Steps are interchangeable, so a plan is how many steps run at each degree. The linear
    relaxation has one constraint besides the step count, so an optimum mixes at most two
    degrees: x steps on a faster degree, the rest on a slower, cheaper one, with x the least
    that meets the deadline (the paper's Fig. 5: "two parallelism degrees that just meet their
    deadlines"). All single degrees and pairs are tried: O(|K|^2). Ties go to one degree, then
    to fewer devices. Parts are in ascending degree; their order is no schedule, since the
    plan is redone every round. None if no plan meets the deadline.
    """
    row = cached(step_time).row(request.resolution, max_degree)
    parts = deadline_parts(request.remaining_steps, request.deadline, row, now)
    return [Allocation(steps, k) for steps, k in parts] if parts else None


def deadline_parts(s: int, deadline: float, row: DegreeRow, now: float) -> Parts:
    """`deadline_allocations` of s steps as (steps, degree) pairs over one resolution's `row`;
    () if no plan meets the deadline. Plans are scored (device-time, parts, top degree), the
    least wins, the earlier on a tie."""
    cheapest, t_cheap = row.cheapest
    if now + s * t_cheap <= deadline:  # no plan costs less than every step at the cheapest degree
        return ((s, cheapest),)
    best: tuple[float, int, int] | None = None
    plan: Parts = ()  # the best's parts
    for (slow, t_slow), faster in zip(row.times, row.faster):
        if now + s * t_slow <= deadline:
            score = (s * slow * t_slow, 1, slow)
            if best is None or score < best:
                best, plan = score, ((s, slow),)
        over = now + s * t_slow - deadline  # seconds over the deadline with every step on `slow`
        for fast, t_fast in faster:
            fast_steps = over / (t_slow - t_fast)
            if not 0 < fast_steps <= s - 1:  # <= 0: `slow` alone suffices; > s - 1: only `fast` alone
                continue
            x = math.ceil(fast_steps)
            while x < s and now + (s - x) * t_slow + x * t_fast > deadline:  # float rounding
                x += 1
            if x < s:
                score = ((s - x) * slow * t_slow + x * fast * t_fast, 2, max(slow, fast))
                if best is None or score < best:
                    best, plan = score, ((s - x, slow), (x, fast)) if slow < fast else ((x, fast), (s - x, slow))
    return plan


def round_options(
    request: RoundRequest,
    plan: Sequence[Allocation],
    step_time: StepTime,
    now: float,
    tau: float,
    num_devices: int,
) -> list[RoundOption]:
    """O_i (Algorithm 1, lines 3-12): "none" first, then each allocation m with q_i^m > 0 and
    A_i^m <= N, run for q_i^m = min(s^m, floor(τ / T(A^m))) steps. sv_i(o) = [t_{r+1} + LB_i(o)
    <= D] with LB_i(o) = (steps left after o) x T_i^min; see `rounds.survives` for a request
    that finishes inside the round."""
    step_time = cached(step_time)
    t_min = step_time.fastest(request.resolution, max_degree(num_devices))
    parts = [(part.steps, part.degree) for part in plan]
    at = RoundSteps(request.resolution, step_time, tau)
    return [RoundOption(0, 0, survives(request, 0, 0.0, t_min, tau, now)),
            *(RoundOption(*o) for o in part_options(request, parts, at, t_min, now, tau, num_devices))]


def part_options(request: RoundRequest, parts: Sequence[tuple[int, int]], at: RoundSteps, t_min: float,
                 now: float, tau: float, num_devices: int) -> list[tuple[int, int, bool]]:
    """(A^m, q_i^m, sv_i) of each (steps, degree) part of a plan that runs this round: A^m <= N
    and q_i^m = min(s^m, floor(τ / T(A^m))) > 0; `at` holds the request's resolution, `t_min`
    its fastest step over the degrees N allows."""
    options = []
    for steps, k in parts:
        if k <= num_devices:
            t, most = at[k]
            q = steps if steps < most else most  # steps_in_round(t, tau, steps)
            if q > 0:
                options.append((k, q, survives(request, q, t, t_min, tau, now)))
    return options


class RoundSteps(dict[int, tuple[float, int]]):
    """degree k -> (T(res, k), floor(τ / T(res, k))) for one resolution: its step time and the
    most steps a round holds at that speed. Filled on first use, once per degree."""

    def __init__(self, resolution: Hashable, step_time: StepTable, tau: float):
        super().__init__()
        self.resolution, self.step_time, self.tau = resolution, step_time, tau

    def __missing__(self, k: int) -> tuple[float, int]:
        t = self.step_time(self.resolution, k)
        entry = self[k] = (t, steps_in_round(t, self.tau, sys.maxsize))
        return entry


def fastest_degree(request: RoundRequest, step_time: StepTime, top: int) -> int:
    """The degree with the least step time (the smaller on a tie): best effort for a late request."""
    return min(degrees(top), key=lambda k: (step_time(request.resolution, k), k))
