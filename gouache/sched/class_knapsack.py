"""Algorithm 1's group knapsack over a round's urgent requests, read by class (`round_classes`).

`plan_classes` (knapsack.py) splits each class (tier, resolution, steps left), sorted by
deadline, into those that survive the round idle, those no option saves, and the middle range
between: only the middle can gain from running. `class_knapsack` feeds the middle ranges to
the DP in (tier, deadline) order and returns the degree of each request it runs, reading as
few of them as leave the decision unchanged:

- *Only surviving options enter.* An option that does not survive and takes devices is
  worth no more than "none" and wider, so no choice with the least width for the most value
  (`Knapsack.choice`) takes it, at c* or on the way back to it: leaving it out of its group
  changes which option each group takes in no way (the choice is the same, index for index
  among the options left). A request with no surviving option enters with "none" alone,
  which changes nothing, so it does not enter.
- *A group that changes nothing is left out.* One none of whose options `Knapsack.improves`
  the DP picks "none" at every reachable capacity and leaves `dp` as it is; without it every
  other group picks the same.
- *Runs of a class that cannot change the DP are passed over unread.* An option of degree k
  exists only where a step fits in the round (q > 0), and survives only from a deadline on
  (`_ClassRound`); while no width that may survive at a member's deadline improves the DP
  at the tier's weight, that member and the next up to the deadline where another width may
  survive change nothing. When a request changes the DP, each class being passed over goes
  on from its first member after that request.

Service tiers weigh a survivor (N + 1)^(tiers below): no tier has more than N survivors on
N devices, so one of a higher tier outranks any number of a lower tier's. Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from gouache.sched.deadline_plans import RoundSteps, deadline_parts, fastest_degree, part_options
from gouache.sched.group_knapsack import Knapsack
from gouache.sched.round_classes import RequestClass
from gouache.sched.rounds import RoundOption, RoundRequest, StepTable, degrees, max_degree

Split = tuple[RequestClass, int, int]  # (class, lost, wait): its members [lost, wait) are the middle range

_NONE = RoundOption(0, 0, False)  # a middle-range request's "none": the range ends where "none" survives


def class_knapsack(splits: Sequence[Split], cost: StepTable, num_devices: int, tau: float, now: float,
                   known: dict[str, tuple[tuple, RoundRequest]]) -> dict[str, int]:
    """Algorithm 1 over the classes' middle ranges, in (tier, deadline) order: the degree of
    each request the DP runs (by id), each noted in `known` with its order."""
    top = max_degree(num_devices)
    lowest = max((c.tier for c, _, _ in splits), default=0)
    knapsack, entered = Knapsack(num_devices), []
    rounds = [_ClassRound(c, cost, num_devices, tau, now, top) if lost < wait else None for c, lost, wait in splits]
    weights = [(num_devices + 1) ** (lowest - c.tier) for c, _, _ in splits]
    improving: dict[int, frozenset[int]] = {}  # class -> its widths that improve dp at its weight, while dp stays
    version = [0] * len(splits)  # a class's heap entries of an older version are stale
    skipped: dict[int, int] = {}  # class -> the first member of the run it is passing over

    def entry(n: int, i: int) -> tuple[tuple, int, int, int]:
        return splits[n][0].order(i), n, i, version[n]

    # (order, class, member, version) of the next member to read of each middle range: they merge in order
    heap = [entry(n, lost) for n, (_, lost, wait) in enumerate(splits) if lost < wait]
    heapq.heapify(heap)
    item = heapq.heappop(heap) if heap else None
    while item is not None:
        order, n, i, v = item
        if v != version[n]:
            item = heapq.heappop(heap) if heap else None
            continue
        c, _, stop = splits[n]
        weight, this = weights[n], rounds[n]
        count = this.valued_at(c.deadline(i))
        widths = improving.get(n)
        if widths is None:
            widths = improving[n] = frozenset(w for w in this.valued if knapsack.improves(w, weight))
        if widths.isdisjoint(this.prefixes[count]):  # nor do its next members, up to the next threshold
            skipped.setdefault(n, i)
            j = c.bisect(this.thresholds[count]) if count < len(this.thresholds) else stop
            item = _next(heap, entry(n, j) if j < stop else None)
            continue
        if skipped:
            skipped.pop(n, None)
        request = c.request(i)
        options = this.surviving(request)
        if any(k in widths for k, _, _ in options):  # `valued` holds every width an option can have
            entered.append((order, request))
            knapsack.add([_NONE, *(RoundOption(*o) for o in options)], weight)
            improving.clear()
            for m, first in skipped.items():  # what they passed over after this request must be read
                version[m] += 1
                d, _, end = splits[m]
                if d.tier == c.tier:  # a higher tier's class has no member after it
                    j = d.after(order, first)
                    if j < end:
                        heapq.heappush(heap, entry(m, j))
            skipped.clear()
        # else no option of it changes dp (none, if it has none that survives)
        item = _next(heap, entry(n, i + 1) if i + 1 < stop else None)
    runners = {}
    for (order, request), options, j in zip(entered, knapsack.groups, knapsack.choice()):
        if options[j].degree:
            runners[request.request_id] = options[j].degree
            known[request.request_id] = (order, request)
    return runners


def _next(heap: list, entry: tuple | None) -> tuple | None:
    """The least of `heap` and `entry` (None: nothing), taken out; the other stays in `heap`."""
    if entry is None:
        return heapq.heappop(heap) if heap else None
    return heapq.heappushpop(heap, entry)


class _ClassRound:
    """One class in this round: its step times, and by deadline the widths whose options may
    survive. An option of degree k <= N runs q <= q_k = min(s, floor(τ / T_k)) steps (none if
    q_k = 0) and survives iff t_{r+1} + (s - q) x T_min <= D (q < s) or now + s x T_k <= D
    (q = s), so no option of degree k survives below the least of these over q, its threshold."""

    def __init__(self, c: RequestClass, cost: StepTable, num_devices: int, tau: float, now: float, top: int):
        self.cost, self.num_devices, self.tau, self.now, self.top = cost, num_devices, tau, now, top
        self.row, self.at = cost.row(c.resolution, top), RoundSteps(c.resolution, cost, tau)
        s, t_min = c.steps, self.row.fastest
        thresholds = []
        for k in degrees(top):
            t, most = self.at[k]
            q = min(s, most)  # k <= top <= N
            if q == 0:
                continue
            if q < s:
                thresholds.append((now + tau + (s - q) * t_min, k))
            else:
                finish = now + s * t
                thresholds.append((min(finish, now + tau + t_min) if s > 1 else finish, k))
        thresholds.sort()
        self.valued = tuple(k for _, k in thresholds)  # by threshold: the first `count` may survive
        self.prefixes = [frozenset(self.valued[:count]) for count in range(len(self.valued) + 1)]
        self.thresholds = [t for t, _ in thresholds]

    def valued_at(self, deadline: float) -> int:
        """How many of `valued` may survive at `deadline` (`thresholds[count]` is the next
        deadline where one more may, if any)."""
        return bisect.bisect_right(self.thresholds, deadline)

    def surviving(self, request: RoundRequest) -> list[tuple[int, int, bool]]:
        """The (degree, q, True) of each of the member's `round_options` that survives, in
        their order, from its deadline plan (`deadline_parts`), or, where no plan meets the
        deadline, from all its steps at the fastest degree (best effort)."""
        s = request.remaining_steps
        parts = (deadline_parts(s, request.deadline, self.row, self.now)
                 or ((s, fastest_degree(request, self.cost, self.top)),))
        options = part_options(request, parts, self.at, self.row.fastest, self.now, self.tau, self.num_devices)
        return [o for o in options if o[2]]
