"""TetriServe's deadline-aware round scheduler (§4.2, Algorithm 1) as pure functions.

One round of τ seconds over N devices is decided in five steps, each its own function:

1. `deadline_allocations`: per urgent request, the least device-time plan (s^m, A^m) that
   meets its deadline, mixing at most two power-of-two degrees (`minimal_feasible_degree` is
   the single-degree case). A request is urgent if it neither survives the round without
   running nor is lost whatever it gets; in a burst most requests are one or the other, and
   those two tests cost O(1) per request.
2. `round_options`: its knapsack group O_i for this round: none, or one allocation m run for
   q = min(s^m, floor(τ / T(A^m))) steps, each with width A^m and survival sv_i(o).
3. `group_knapsack`: Algorithm 1's DP over capacity N, maximising surviving requests.
4. `elastic_scale_up` (elastic.py), then `selective_batching` (batching.py): idle devices and
   requests left out.
5. `place` (placement.py): aligned device blocks, preserving last round's placement.

`plan_round` ties them together over a list; `plan_classes` over requests grouped and sorted by
class (`round_classes`), reading only the requests it must: the round-knapsack policy calls it
with the scheduler's queue. Nothing here imports torch, and `gouache.sched.knapsack` re-exports
the whole API.
"""

from __future__ import annotations

import bisect
import heapq
import math
import sys
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence

from gouache.sched.batching import batch_joiners, batch_step, selective_batching
from gouache.sched.elastic import elastic_scale_up, scale_up
from gouache.sched.placement import place
from gouache.sched.round_classes import RequestClass, by_deadline, by_order, merged, of_requests
from gouache.sched.rounds import (
    Allocation,
    BatchStepTime,
    RoundAllocation,
    RoundOption,
    RoundDecision,
    RoundRequest,
    StepTable,
    StepTime,
    cached,
    degrees,
    max_degree,
    steps_in_round,
    survives,
)

__all__ = [
    "Allocation",
    "BatchStepTime",
    "RoundAllocation",
    "RoundOption",
    "RoundDecision",
    "RoundRequest",
    "StepTime",
    "deadline_allocations",
    "elastic_scale_up",
    "group_knapsack",
    "Knapsack",
    "minimal_feasible_degree",
    "place",
    "plan_classes",
    "plan_round",
    "round_options",
    "selective_batching",
]


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
    """§4.2.1: min sum_j A_j x T(A_j) subject to sum_j T(A_j) <= D - now, over the remaining steps.

    Steps are interchangeable, so a plan is how many steps run at each degree. The linear
    relaxation has one constraint besides the step count, so an optimum mixes at most two
    degrees: x steps on a faster degree, the rest on a slower, cheaper one, with x the least
    that meets the deadline (the paper's Fig. 5: "two parallelism degrees that just meet their
    deadlines"). All single degrees and pairs are tried: O(|K|^2). Ties go to one degree, then
    to fewer devices. Parts are in ascending degree; their order is no schedule, since the
    plan is redone every round. None if no plan meets the deadline.
    """
    s, deadline = request.remaining_steps, request.deadline
    row = cached(step_time).row(request.resolution, max_degree)
    cheapest, t_cheap = row.cheapest
    if now + s * t_cheap <= deadline:  # no plan costs less than every step at the cheapest degree
        return [Allocation(s, cheapest)]
    # Plans are scored (device-time, parts, top degree), the least wins, the earlier on a tie;
    # only the winner's Allocations are made.
    best: tuple[float, int, int] | None = None
    plan: tuple[tuple[int, int], ...] = ()  # the best's (steps, degree) parts
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
    return [Allocation(steps, k) for steps, k in plan] if plan else None


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
    options = [RoundOption(0, 0, survives(request, 0, 0.0, t_min, tau, now))]
    for part in plan:
        if part.degree > num_devices:
            continue
        t = step_time(request.resolution, part.degree)
        q = steps_in_round(t, tau, part.steps)
        if q > 0:
            options.append(RoundOption(part.degree, q, survives(request, q, t, t_min, tau, now)))
    return options


class Knapsack:
    """Algorithm 1's DP (lines 13-22), one group at a time: `add` each request's options in
    order, then `choice`. `dp[c]` is the best value with exactly c devices used (-1:
    unreachable); `back[i][c]` the option group i took to reach c."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.dp = [0] + [-1] * capacity
        self.back: list[list[int]] = []
        self.groups: list[Sequence[RoundOption]] = []

    def add(self, options: Sequence[RoundOption], weight: int = 1) -> bool:
        """One more group, each surviving option worth `weight`; whether `dp` changed. Each
        capacity sees the options in order, so the first best is kept."""
        if not options:
            raise ValueError("every group needs at least one option (e.g. a width-0 'none')")
        capacity, dp = self.capacity, self.dp
        nxt, pick = [-1] * (capacity + 1), [-1] * (capacity + 1)
        for j, o in enumerate(options):
            w, v = o.degree, weight if o.survives else 0  # its width and value, as plain attributes
            for c in range(w, capacity + 1):
                count = dp[c - w]
                if count >= 0 and count + v > nxt[c]:
                    nxt[c], pick[c] = count + v, j
        self.back.append(pick)
        self.groups.append(options)
        changed, self.dp = nxt != dp, nxt
        return changed

    def saturated(self, weight: int, widths: Sequence[int], valued: Collection[int] = ()) -> bool:
        """Whether no group whose options besides "none" are as wide as one of `widths` (all
        >= 1), those worth anything worth at most `weight` and as wide as one of `valued`, can
        change `dp`: every such option, at every capacity it reaches, is no better than what is
        there. Such a group picks its first option ("none", width 0) at every reachable
        capacity, so leaving it out changes neither the optimum nor which choice `choice`
        returns, and `dp` stays as it is for the next."""
        dp = self.dp
        return all(dp[c - w] < 0 or dp[c] >= dp[c - w] + (weight if w in valued else 0)
                   for w in widths for c in range(w, self.capacity + 1))

    def choice(self) -> list[int]:
        """The index of the option chosen in each group: the most value, then the least total
        width (c* is the first argmax)."""
        dp = self.dp
        c = max(range(self.capacity + 1), key=lambda c: (dp[c], -c))
        if dp[c] < 0:
            raise ValueError(f"no choice fits in capacity {self.capacity}: some group has no option that narrow")
        choice = [0] * len(self.groups)
        for i in reversed(range(len(self.groups))):
            choice[i] = self.back[i][c]
            c -= self.groups[i][choice[i]].width
        return choice


def group_knapsack(groups: Sequence[Sequence[RoundOption]], capacity: int,
                   weights: Sequence[int] | None = None) -> list[int]:
    """Algorithm 1, lines 13-22: the index of the option chosen in each group.

    Exactly one option per group is chosen (give each a width-0 "none" to allow skipping), the
    widths sum to at most `capacity`, and the number of surviving options is maximal (each
    counted `weights[i]` times, where given: service tiers); among maximal choices the total
    width is least (c* is the first argmax). O(R x N x |O|) time, O(R x N) for the
    back-pointers.
    """
    knapsack = Knapsack(capacity)
    for i, options in enumerate(groups):
        knapsack.add(options, 1 if weights is None else weights[i])
    return knapsack.choice()


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
    middle one gets options (O(|K|^2) each). Those enter the DP in (tier, deadline) order
    until it is saturated for their tier's weight (`Knapsack.saturated`): from there on no one
    of that tier or a lower one can change it. Scale-up reads the heads of the classes of
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
            raise ValueError(f"{c.request(0).request_id}: remaining_steps must be >= 1 (finished requests leave the round)")
        t_min, q_cap = bounds[c.resolution]
        wait = c.bisect(end + s * t_min)  # "none" survives from here, as rounds.survives(request, 0, 0.0, ...)
        lost_below = end + (s - q_cap if s > q_cap else 1) * t_min  # with the fewest steps an unfinished option leaves
        if q_cap >= s:  # or it finishes in the round, at best at the fastest degree
            lost_below = min(lost_below, now + s * t_min)
        splits.append((c, min(c.bisect(lost_below), wait), wait))

    known: dict[str, tuple[tuple, RoundRequest]] = {}  # id -> (order, request) of every request read that may run
    degree = _knapsack_runners(splits, cost, num_devices, tau, now, known)

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


def _knapsack_runners(splits: Sequence[tuple[RequestClass, int, int]], cost: StepTable, num_devices: int,
                      tau: float, now: float, known: dict[str, tuple[tuple, RoundRequest]]) -> dict[str, int]:
    """Algorithm 1 over the classes' middle ranges, in (tier, deadline) order: the degree of
    each request the DP runs (by id), each noted in `known`. A request some option saves
    enters the DP; one none saves takes "none".

    Most members of a class would enter as groups that change nothing (`Knapsack.saturated`),
    and are passed over unread. A class's options are as wide as the degrees at which a step
    fits in the round (q > 0), and one of degree k can survive only from a deadline on
    (`_Widths`), so its members between two such deadlines have the same widths and valued
    widths: while the DP is saturated for those, they are skipped to the next such deadline.
    When a request changes the DP, each class being skipped goes on from its first member
    after that request."""
    top = max_degree(num_devices)
    lowest = max((c.tier for c, _, _ in splits), default=0)
    knapsack, entered = Knapsack(num_devices), []
    widths = [_Widths(c, cost, num_devices, tau, now, top) for c, _, _ in splits]
    weights = [(num_devices + 1) ** (lowest - c.tier) for c, _, _ in splits]
    saturated: dict[tuple[int, int], bool] = {}  # (class, valued widths' count) -> saturated, while dp stays
    version = [0] * len(splits)  # a class's heap entries of an older version are stale
    skipped: dict[int, int] = {}  # class -> the first member of the run it is skipping
    heap: list[tuple[tuple, int, int, int]] = []  # (order, class, member, version): the middle ranges, merged

    def push(n: int, i: int) -> None:
        heapq.heappush(heap, (splits[n][0].order(i), n, i, version[n]))

    for n, (c, lost, wait) in enumerate(splits):
        if lost < wait:
            push(n, lost)
    while heap:
        order, n, i, v = heapq.heappop(heap)
        if v != version[n]:
            continue
        c, _, stop = splits[n]
        fits, count, until = widths[n].at(c.deadline(i))
        key = (n, count)
        if key not in saturated:
            saturated[key] = knapsack.saturated(weights[n], fits, widths[n].valued[:count])
        if saturated[key]:  # so are its members up to the deadline where one more width may be valued
            skipped.setdefault(n, i)
            j = c.bisect(until)
            if j < stop:
                push(n, j)
            continue
        skipped.pop(n, None)
        if i + 1 < stop:
            push(n, i + 1)
        request = c.request(i)
        plan = deadline_allocations(request, cost, now, top)
        if plan is None:  # hopeless: its one allocation is the fastest degree, for best effort
            plan = [Allocation(request.remaining_steps, _fastest(request, cost, top))]
        options = round_options(request, plan, cost, now, tau, num_devices)
        if not any(o.survives for o in options):
            continue
        entered.append((order, request))
        if knapsack.add(options, weights[n]):
            saturated.clear()
            for m, first in skipped.items():  # what they skipped after this request must be read
                version[m] += 1
                d, _, end = splits[m]
                if d.tier == c.tier:  # a higher tier's class has no member after it
                    j = d.after(order, first)
                    if j < end:
                        push(m, j)
            skipped.clear()
    runners = {}
    for (order, request), options, j in zip(entered, knapsack.groups, knapsack.choice()):
        if options[j].degree:
            runners[request.request_id] = options[j].degree
            known[request.request_id] = (order, request)
    return runners


class _Widths:
    """The widths of a class's options: the degrees k <= N at which a step fits in the round
    (q_k = min(s, floor(τ / T_k)) > 0), and, by deadline, those whose option can survive. An
    option of degree k runs q <= q_k steps and survives iff t_{r+1} + (s - q) x T_min <= D
    (q < s) or now + s x T_k <= D (q = s), so no option of degree k survives below the least
    of these over q, its threshold."""

    def __init__(self, c: RequestClass, cost: StepTable, num_devices: int, tau: float, now: float, top: int):
        s, t_min = c.steps, cost.fastest(c.resolution, top)
        thresholds = []
        for k in degrees(top):
            q = steps_in_round(cost(c.resolution, k), tau, s) if k <= num_devices else 0
            if q == 0:
                continue
            if q < s:
                thresholds.append((now + tau + (s - q) * t_min, k))
            else:
                finish = now + s * cost(c.resolution, k)
                thresholds.append((min(finish, now + tau + t_min) if s > 1 else finish, k))
        thresholds.sort()
        self.fits = tuple(sorted(k for _, k in thresholds))
        self.valued = tuple(k for _, k in thresholds)  # by threshold: the first `count` may be valued
        self.thresholds = [t for t, _ in thresholds]

    def at(self, deadline: float) -> tuple[tuple[int, ...], int, float]:
        """(the widths, how many of `valued` may be worth something at `deadline`, the next
        threshold above it: inf if none)."""
        count = bisect.bisect_right(self.thresholds, deadline)
        return self.fits, count, self.thresholds[count] if count < len(self.thresholds) else math.inf


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


def _fastest(request: RoundRequest, step_time: StepTime, top: int) -> int:
    """The degree with the least step time (the smaller on a tie): best effort for a late request."""
    return min(degrees(top), key=lambda k: (step_time(request.resolution, k), k))


def _check_round(num_devices: int, tau: float, max_batch: int) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not tau > 0:
        raise ValueError(f"the round length tau must be > 0 seconds, got {tau}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
