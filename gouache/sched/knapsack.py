"""TetriServe's deadline-aware round scheduler (§4.2, Algorithm 1) as pure functions.

One round of τ seconds over N devices is decided in five steps, each in its own module:

1. `deadline_allocations` (deadline_plans.py): per urgent request, the least device-time
   plan (s^m, A^m) that meets its deadline, mixing at most two power-of-two degrees
   (`minimal_feasible_degree` is the single-degree case). A request is urgent if it neither
   survives the round without running nor is lost whatever it gets; in a burst most requests
   are one or the other, and those two tests cost O(1) per request.
2. `round_options` (deadline_plans.py): its knapsack group O_i for this round: none, or one
   allocation m run for q = min(s^m, floor(τ / T(A^m))) steps, each with width A^m and
   survival sv_i(o).
3. `group_knapsack` (group_knapsack.py): Algorithm 1's DP over capacity N, maximising
   surviving requests; `class_knapsack` (class_knapsack.py) runs it over the urgent requests
   of each class, reading only those that can change it.
4. `elastic_scale_up` (elastic.py), then `selective_batching` (batching.py): idle devices and
   requests left out.
5. `place` (placement.py): aligned device blocks, preserving last round's placement.

`plan_round` ties them together over a list; `plan_classes` over requests grouped and sorted by
class (`round_classes`), reading only the requests it must: the round-knapsack policy calls it
with the scheduler's queue. Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

from gouache.sched.batching import batch_joiners, batch_step
from gouache.sched.class_knapsack import class_knapsack
from gouache.sched.elastic import scale_up
from gouache.sched.placement import place
from gouache.sched.round_classes import RequestClass, by_deadline, by_order, merged, of_requests
from gouache.sched.rounds import (
    BatchStepTime,
    RoundAllocation,
    RoundDecision,
    RoundRequest,
    StepTable,
    StepTime,
    cached,
    max_degree,
    steps_in_round,
    survives,
)


def plan_round(
    requests: Sequence[RoundRequest],
    step_time: StepTime,
    num_devices: int,
    tau: float,
    now: float,
    previous_placement: Mapping[str, Sequence[int]] | None = None,
    *,
    batch_step_time: BatchStepTime | None = None,
    max_batch: int = 8,
    run_late: bool = True,
) -> RoundDecision:
    """Decide one round: which requests run, on which devices, for how many steps.

    Requests are taken by service tier, then earliest deadline first, so every tie below
    favours a higher tier, then the earlier deadline; the DP counts a survivor of a higher tier
    above any number of a lower tier's ((N + 1)^(tiers below) each: no tier has more than N
    survivors on N devices).
    The DP runs on the urgent requests only: those that survive without running ("none" has
    sv = 1) or cannot survive whatever they get take "none" in some optimal choice, and
    leaving them out gives the same optimum (the paper: "to decide which requests must be
    scheduled now"). Idle devices then go to the surviving requests (elastic scale-up), then,
    if `run_late`, to the rest best-effort; requests still without devices may batch with a
    same-resolution one-device request when `batch_step_time` is given. A scheduled request
    runs floor(τ / T) steps (capped by what it has left), not the DP's q_i^m: doing more of
    its work early never hurts its deadline. Requests that are definitely late under the
    final plan are listed in `late` for the caller to drop or keep.

    This sorts its requests into classes (`round_classes`) and plans them (`plan_classes`).
    """
    _check_round(num_devices, tau, max_batch)
    return plan_classes(of_requests(requests), step_time, num_devices, tau, now, previous_placement,
                        batch_step_time=batch_step_time, max_batch=max_batch, run_late=run_late)


def plan_classes(
    classes: Sequence[RequestClass],
    step_time: StepTime,
    num_devices: int,
    tau: float,
    now: float,
    previous_placement: Mapping[str, Sequence[int]] | None = None,
    *,
    batch_step_time: BatchStepTime | None = None,
    max_batch: int = 8,
    run_late: bool = True,
    late: bool = True,
) -> RoundDecision:
    """`plan_round` over requests in classes (tier, resolution, steps left), each sorted by
    deadline; it reads only the requests it must (`late=False` leaves `late` empty, which
    would read every request that misses the round).

    With T_min a class's fastest step and q_cap = floor(τ / T_min), a member survives idle iff
    t_{r+1} + s x T_min <= D, and no option saves it iff t_{r+1} + max(s - q_cap, 1) x T_min > D
    and it cannot finish in the round (q_cap < s or now + s x T_min > D): both are thresholds on
    the deadline, so each class splits into three ranges by two binary searches, and only the
    middle one can gain from running. The DP reads those in (tier, deadline) order, only as
    many as can change it (`class_knapsack`). Scale-up reads the heads of the classes of
    each (resolution, steps) in deadline order, and selective batching the joiners of each
    resolution in deadline order until one fits no batch (when late requests may run, the
    joiners of a resolution are interchangeable: whether one fits depends on the batches only).
    """
    _check_round(num_devices, tau, max_batch)
    cost, top, end = cached(step_time), max_degree(num_devices), now + tau
    bounds = _Bounds(cost, top, tau)
    splits: list[tuple[RequestClass, int, int]] = []  # (class, lost, wait): [0, lost) lost, [wait, n) survive idle
    for c in classes:
        if not len(c):
            continue
        s = c.steps
        if s < 1:
            raise ValueError(f"{c.request(0).request_id}: remaining_steps must be >= 1 "
                             "(finished requests leave the round)")
        t_min, q_cap = bounds[c.resolution]
        wait = c.bisect(end + s * t_min)  # "none" survives from here, as rounds.survives(request, 0, 0.0, ...)
        lost_below = end + (s - q_cap if s > q_cap else 1) * t_min  # with the fewest steps an unfinished option leaves
        if q_cap >= s:  # or it finishes in the round, at best at the fastest degree
            lost_below = min(lost_below, now + s * t_min)
        splits.append((c, min(c.bisect(lost_below), wait), wait))

    known: dict[str, tuple[tuple, RoundRequest]] = {}  # id -> (order, request) of every request read that may run
    degree = class_knapsack(splits, cost, num_devices, tau, now, known)

    def queue(parts, skip=None) -> Iterator[tuple[tuple, RoundRequest]]:
        for (_, order), c, i in merged(parts, by_deadline, skip):
            request = c.request(i)
            known[request.request_id] = (order, request)
            yield order, request

    if sum(degree.values()) < num_devices:  # else scale-up has nothing to hand out
        running = [known[rid] for rid in degree]
        shapes = _by(((c, wait, len(c)) for c, _, wait in splits), lambda c: (c.resolution, c.steps))
        degree = scale_up(degree, running, [queue(parts) for parts in shapes.values()], cost, tau, num_devices)
    if run_late and sum(degree.values()) < num_devices:
        runners = set(degree)
        shapes = _by(((c, 0, wait) for c, _, wait in splits), lambda c: (c.resolution, c.steps))
        degree = scale_up(degree, [], [queue(parts, lambda c, i: c.request(i).request_id in runners)
                                       for parts in shapes.values()], cost, tau, num_devices)
    host = {rid: rid for rid in degree}  # whose devices each running request uses
    step_s = {rid: cost(known[rid][1].resolution, k) for rid, k in degree.items()}  # seconds per step
    batches: list[list[str]] = []
    if batch_step_time is not None:
        hosts = [request for _, request in sorted(known[rid] for rid, k in degree.items() if k == 1)]
        by_resolution = _by(((c, 0, len(c)) for c, _, _ in splits), lambda c: c.resolution)

        def joiners(resolution) -> Iterator[RoundRequest]:
            parts = by_resolution.get(resolution, [])
            return (r for _, r in queue(parts, lambda c, i: c.request(i).request_id in degree))

        batches = batch_joiners(hosts, joiners, cost, batch_step_time, tau, now, num_devices, max_batch, run_late)
        for group in batches:
            t = batch_step(known[group[0]][1].resolution, len(group), cost, batch_step_time)
            host.update((rid, group[0]) for rid in group)
            step_s.update((rid, t) for rid in group)
    devices = place(degree, previous_placement or {}, num_devices)
    allocations = {
        rid: RoundAllocation(devices[host[rid]], steps_in_round(t, tau, known[rid][1].remaining_steps))
        for rid, t in step_s.items()
    }
    late_ids = []
    if late:  # the requests whose "none" does not survive, in order: only they can be late
        for _, c, i in merged(((c, 0, wait) for c, _, wait in splits), by_order):
            request = c.request(i)
            allocation = allocations.get(request.request_id)
            if allocation is None or _late(request, allocation.steps, step_s[request.request_id], cost, tau, now, top):
                late_ids.append(request.request_id)
    return RoundDecision(allocations=allocations, batches=batches, late=late_ids)


def _by(parts: Iterable[tuple[RequestClass, int, int]], key) -> dict:
    """The parts grouped by `key` of their class, in order of first appearance."""
    out: dict = {}
    for part in parts:
        out.setdefault(key(part[0]), []).append(part)
    return out


class _Bounds(dict[Hashable, tuple[float, int]]):
    """resolution -> (T_min, floor(τ / T_min)): its fastest step and the most steps a round
    holds at that speed. Filled on first use: once per resolution, not per request."""

    def __init__(self, cost: StepTable, top: int, tau: float):
        super().__init__()
        self.cost, self.top, self.tau = cost, top, tau

    def __missing__(self, resolution: Hashable) -> tuple[float, int]:
        t_min = self.cost.fastest(resolution, self.top)
        bound = self[resolution] = (t_min, steps_in_round(t_min, self.tau, sys.maxsize))
        return bound


def _late(request: RoundRequest, steps: int, step_s: float, cost: StepTable, tau: float, now: float, top: int) -> bool:
    """Whether `request`, run `steps` steps of `step_s` seconds this round, is definitely late at t_{r+1}."""
    return not survives(request, steps, step_s, cost.fastest(request.resolution, top), tau, now)


def _check_round(num_devices: int, tau: float, max_batch: int) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not tau > 0:
        raise ValueError(f"the round length tau must be > 0 seconds, got {tau}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
