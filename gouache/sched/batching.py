"""Selective continuous batching (TetriServe §5): same-resolution small requests share a forward.

The paper gives the rule, not the mechanism: batching "is only effective for identical,
small-resolution requests that would otherwise underutilize GPUs", and requests are grouped
"only if their SLOs are not compromised". Our reading, in the round model:

- small = the request runs on one device this round (a request given 2+ devices is there
  because it needs the speed; batching it would undo that), and a batch one larger must raise
  throughput, B(res, b + 1) / (b + 1) < B(res, b) / b: the cost model, not a size threshold,
  says which resolutions leave a device underused;
- the requests that would otherwise not run this round (every device is taken after the DP
  and elastic scale-up) join a one-device request of the same resolution, earliest deadline
  first, into the smallest such group with room;
- no SLO suffers = for every member already in the group, the smallest degree with which it
  could still meet its deadline from t_{r+1} does not grow (and one that finishes inside the
  round still finishes by its deadline). The joiner itself can only gain; when late requests
  are not run best-effort, it must also survive the round.

A batch of b runs floor(τ / B(res, b)) steps of each member (capped by what it has left),
B being `batch_step_time`; a member alone runs at `step_time(res, 1)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from operator import attrgetter

from gouache.sched.rounds import (
    BatchStepTime,
    RoundRequest,
    StepTime,
    cached,
    degrees,
    fastest_step,
    max_degree,
    steps_in_round,
    survives,
)


def selective_batching(
    degrees_now: Mapping[str, int],
    requests: Sequence[RoundRequest],
    step_time: StepTime,
    batch_step_time: BatchStepTime,
    tau: float,
    now: float,
    num_devices: int,
    max_batch: int = 8,
    allow_late: bool = True,
) -> list[list[str]]:
    """Batches as lists of ids, the one-device host first; only groups of 2 or more.

    `degrees_now` is the round's degree per id (absent = not running); `requests` are all the
    round's requests. Joiners are the requests absent from `degrees_now` whose resolution has a
    one-device host, taken by deadline (ties in the order of `requests`)."""
    hosts = [r for r in requests if degrees_now.get(r.request_id) == 1]
    resolutions = {r.resolution for r in hosts}
    joiners = {res: [] for res in resolutions}
    for r in sorted((r for r in requests if r.resolution in resolutions and r.request_id not in degrees_now),
                    key=attrgetter("deadline")):
        joiners[r.resolution].append(r)
    return batch_joiners(hosts, lambda res: iter(joiners[res]), step_time, batch_step_time, tau, now, num_devices,
                         max_batch, allow_late)


def batch_joiners(
    hosts: Sequence[RoundRequest],
    joiners: Callable[[Hashable], Iterator[RoundRequest]],
    step_time: StepTime,
    batch_step_time: BatchStepTime,
    tau: float,
    now: float,
    num_devices: int,
    max_batch: int = 8,
    allow_late: bool = True,
) -> list[list[str]]:
    """`selective_batching` with the one-device `hosts` in order and, per resolution, its
    joiners as they are read (by deadline). Each joiner joins the smallest group of its
    resolution with room that gains throughput and whose members keep their outlook. Whether
    one joins depends on the groups only, unless late joiners are refused (`allow_late`
    False: it must survive the round), so otherwise the first that joins none ends its
    resolution: O(joined + resolutions) joiners read. O(b x |K|) per change of a batch of b:
    whether its members keep their outlook is computed once per size.
    """
    step_time, batch_step_time, top = cached(step_time), cached(batch_step_time), max_degree(num_devices)
    groups: dict[Hashable, list[list[RoundRequest]]] = {}
    for request in hosts:
        groups.setdefault(request.resolution, []).append([request])
    members_ok: dict[int, bool] = {}  # id(group) -> its members keep their outlook with one more; dropped on change
    for resolution, own in groups.items():
        for joiner in joiners(resolution):
            joined = False
            for group in sorted(own, key=len):
                if len(group) >= max_batch:
                    continue
                t_old = batch_step(resolution, len(group), step_time, batch_step_time)
                t_new = batch_step(resolution, len(group) + 1, step_time, batch_step_time)
                if t_new / (len(group) + 1) >= t_old / len(group):
                    continue  # no throughput gain: this resolution already fills a device
                done = steps_in_round(t_new, tau, joiner.remaining_steps)
                t_min = fastest_step(joiner, step_time, top)
                if done == 0 or not (allow_late or survives(joiner, done, t_new, t_min, tau, now)):
                    continue
                if id(group) not in members_ok:
                    members_ok[id(group)] = all(_keeps_outlook(m, t_old, t_new, step_time, tau, now, top)
                                                for m in group)
                if members_ok[id(group)]:
                    group.append(joiner)
                    del members_ok[id(group)]
                    joined = True
                    break
            if not joined and allow_late:  # the next would fit nowhere either
                break
    return [[m.request_id for m in g] for gs in groups.values() for g in gs if len(g) > 1]


def batch_step(resolution: object, size: int, step_time: StepTime, batch_step_time: BatchStepTime) -> float:
    """Seconds per step of `size` requests of `resolution` sharing one device."""
    return step_time(resolution, 1) if size == 1 else batch_step_time(resolution, size)


def _keeps_outlook(
    member: RoundRequest, t_old: float, t_new: float, step_time: StepTime, tau: float, now: float, top: int
) -> bool:
    """Whether running at t_new instead of t_old seconds per step this round leaves `member`
    needing no larger degree from t_{r+1} (and, if it finishes in the round, still on time)."""
    before = steps_in_round(t_old, tau, member.remaining_steps)
    after = steps_in_round(t_new, tau, member.remaining_steps)
    return _outlook(member, after, t_new, step_time, tau, now, top) <= _outlook(
        member, before, t_old, step_time, tau, now, top
    )


def _outlook(
    request: RoundRequest, done: int, step_s: float, step_time: StepTime, tau: float, now: float, top: int
) -> float:
    """The smallest degree that still meets the deadline from t_{r+1} after `done` steps this
    round (0 if it finishes in time inside the round); inf if none does."""
    left = request.remaining_steps - done
    if left == 0:
        return 0 if now + done * step_s <= request.deadline else math.inf
    for k in degrees(top):
        if now + tau + left * step_time(request.resolution, k) <= request.deadline:
            return k
    return math.inf
