"""The waiting requests of one scheduler, kept in the orders the policies read, as they come and go.

A policy decides every step, over every waiting request; at fleet scale a replica can hold
thousands. Sorting them each time (tens of microseconds per hundred, milliseconds per ten
thousand) was most of a decision, so the orders are kept up to date instead, each change a
binary search and a list insertion or deletion:

- `ordered`: every waiting request in `tiers.queue_order` (tier, fair-queue tag, arrival), ties
  in the order they joined: what every policy is given;
- `ordered.classes`: the same requests grouped by what their slack depends on besides the
  deadline (tier, resolution, steps, steps done), each group by deadline (none last), then
  queue order. Within a group, least slack is earliest deadline, so a deadline policy merges
  the groups' heads instead of sorting everyone (`patched-slo`).

A request's keys are taken when it joins; its fields must not change while it waits (the
scheduler changes them only while it runs).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, MutableMapping

from gouache.request import RequestState
from gouache.sched.tiers import queue_order

Shape = tuple[int, tuple[int, int], int, int]  # tier, resolution, steps, steps done


def shape(state: RequestState) -> Shape:
    return state.tier, state.resolution, state.num_steps, state.steps_done


class Sorted:
    """States sorted by a key taken at insertion (`states`, a list to read); the keys are unique."""

    def __init__(self, states: list[RequestState] | None = None):
        self.keys: list[tuple] = []
        self.states: list[RequestState] = [] if states is None else states

    def insert(self, key: tuple, state: RequestState) -> None:
        i = bisect.bisect_right(self.keys, key)
        self.keys.insert(i, key)
        self.states.insert(i, state)

    def remove(self, key: tuple) -> None:
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i], self.states[i]


class Ordered(list):
    """The waiting states in queue order (a plain list to read), with `classes`: shape -> the
    `Sorted` of that shape's states by deadline."""

    classes: dict[Shape, Sorted]


class WaitingQueue(MutableMapping[str, RequestState]):
    """Request id -> state, iterated in the order they joined, with `ordered` kept up to date."""

    def __init__(self):
        self._states: dict[str, RequestState] = {}
        # id -> its queue-order key (ending with its joining number), its shape, its key in that shape's group
        self._keys: dict[str, tuple[tuple, Shape, tuple]] = {}
        self.ordered = Ordered()
        self.ordered.classes = {}
        self._order = Sorted(self.ordered)
        self._seq = itertools.count()

    def __getitem__(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def __setitem__(self, request_id: str, state: RequestState) -> None:
        if request_id in self._states:
            del self[request_id]
        key = (*queue_order(state), next(self._seq))
        group, by_deadline = shape(state), (math.inf if state.deadline is None else state.deadline, *key)
        self._states[request_id], self._keys[request_id] = state, (key, group, by_deadline)
        self._order.insert(key, state)
        self.ordered.classes.setdefault(group, Sorted()).insert(by_deadline, state)

    def __delitem__(self, request_id: str) -> None:
        del self._states[request_id]
        key, group, by_deadline = self._keys.pop(request_id)
        self._order.remove(key)
        members = self.ordered.classes[group]
        members.remove(by_deadline)
        if not members.keys:
            del self.ordered.classes[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

