"""A round's requests grouped by class, so that planning a round reads few of them.

The round planner (knapsack.py) reads its requests in the order (tier, deadline, input order),
and most of what it decides about one depends only on its class, (tier, resolution, steps
left), and its deadline: whether it survives the round idle, whether anything can save it,
which of its class runs first when devices are idle. Within a class those are thresholds on
the deadline, so a class kept sorted by deadline splits into ranges by binary search, and a
round at 10,000 waiting requests touches the few near a threshold or at a class's head.

A `RequestClass` is that sorted class. `keys[i]` is member i's sort key within its class, its
deadline first (so `bisect` finds a deadline), then what orders ties: the members' input
order. Across classes, member i comes in the order `order(i)` = (tier, deadline, rank, rest of
its key), `rank` telling sources apart (the round policy's running requests come before its
waiting ones; within a rank the rest of the keys compare as the input order). `request(i)`
makes member i's `RoundRequest` only when asked.

`of_requests` builds the classes of a list, each member keyed by its position; the round
policy builds its waiting classes from the scheduler's queue (`sched.waiting`), which keeps
them sorted as requests come and go.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from gouache.sched.rounds import RoundRequest

Key = tuple  # a member's key: (deadline, ...ties)


class RequestClass:
    """The members of one (tier, resolution, steps left), ascending by `keys`."""

    __slots__ = ("tier", "resolution", "steps", "keys", "rank", "_make")

    def __init__(self, tier: int, resolution: Hashable, steps: int, keys: Sequence[Key], rank: int,
                 make: Callable[[int], RoundRequest]):
        self.tier, self.resolution, self.steps = tier, resolution, steps
        self.keys = keys  # ascending; keys[i][0] is member i's deadline
        self.rank = rank  # orders classes' members on equal (tier, deadline): the lower first
        self._make = make  # i -> member i's RoundRequest

    def __len__(self) -> int:
        return len(self.keys)

    def bisect(self, deadline: float) -> int:
        """How many members have a deadline below `deadline`."""
        return bisect.bisect_left(self.keys, (deadline,))

    def deadline(self, i: int) -> float:
        return self.keys[i][0]

    def order(self, i: int) -> tuple:
        """Member i's place among every class's members: (tier, deadline, rank, ties)."""
        key = self.keys[i]
        return self.tier, key[0], self.rank, key[1:]

    def request(self, i: int) -> RoundRequest:
        return self._make(i)

    def after(self, order: tuple, lo: int = 0) -> int:
        """The first member from `lo` whose `order` is past `order`, one of the same tier."""
        _, deadline, rank, rest = order
        if rank < self.rank:  # on an equal deadline this class comes after
            return bisect.bisect_left(self.keys, (deadline,), lo)
        if rank > self.rank:
            return bisect.bisect_right(self.keys, deadline, lo, key=lambda key: key[0])
        return bisect.bisect_right(self.keys, (deadline, *rest), lo)


def of_requests(requests: Sequence[RoundRequest]) -> list[RequestClass]:
    """The classes of `requests`, ties in their order in the list; their ids must be unique."""
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique within a round")
    members: dict[tuple, list[tuple[float, int]]] = {}
    for i, r in enumerate(requests):
        members.setdefault((r.tier, r.resolution, r.remaining_steps), []).append((r.deadline, i))
    classes = []
    for (tier, resolution, steps), keys in members.items():
        keys.sort()
        classes.append(RequestClass(tier, resolution, steps, keys, 0,
                                    lambda j, keys=keys: requests[keys[j][1]]))
    return classes


def merged(parts: Iterable[tuple[RequestClass, int, int]], key: Callable[[RequestClass, int], tuple],
           skip: Callable[[RequestClass, int], bool] | None = None) -> Iterator[tuple[tuple, RequestClass, int]]:
    """(key, class, i) of the members [start, stop) of each (class, start, stop) part, in `key`
    order (each part ascending in it already), leaving out those `skip` names."""
    heap = [(key(c, start), n, c, start, stop) for n, (c, start, stop) in enumerate(parts) if start < stop]
    heapq.heapify(heap)
    while heap:
        k, n, c, i, stop = heap[0]
        if skip is None or not skip(c, i):
            yield k, c, i
        if i + 1 < stop:
            heapq.heapreplace(heap, (key(c, i + 1), n, c, i + 1, stop))
        else:
            heapq.heappop(heap)


def by_order(c: RequestClass, i: int) -> tuple:
    """The planner's order: (tier, deadline, rank, ties)."""
    return c.order(i)


def by_deadline(c: RequestClass, i: int) -> tuple:
    """Deadline first, then the planner's order (what a stable sort by deadline of the
    planner's order gives)."""
    return c.keys[i][0], c.order(i)
