"""Work-conserving elastic scale-up (TetriServe §4.2.3): devices the DP leaves idle get used.

The DP only spends devices on requests that would otherwise become definitely late, and
breaks ties toward fewer devices, so after it some devices are usually idle. "Requests with
sufficient remaining steps are granted additional GPUs if T_i(k') < T_i(k), prioritizing
those that benefit most from parallelism." Here a request not chosen this round counts as
running on 0 devices, so starting it is the first upgrade: a lone request with a loose
deadline still runs, which the paper's "no GPU remains unused" requires.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

from gouache.sched.rounds import RoundRequest, StepTable, StepTime, cached, max_degree, steps_in_round


def elastic_scale_up(
    degrees_now: Mapping[str, int],
    requests: Sequence[RoundRequest],
    step_time: StepTime,
    tau: float,
    num_devices: int,
) -> dict[str, int]:
    """Hand the devices `degrees_now` leaves idle to `requests`; return the new degree per id.

    A request at degree k (0 if absent) may move to any power of two k' > k that fits in the
    idle devices if it then completes more steps this round (that is the paper's "sufficient
    remaining steps" and T(k') < T(k) read through the round: extra speed that finishes no
    extra step by t_{r+1} only leaves devices idle later in the round). Upgrades are granted
    greedily by benefit per extra device: the drop of the request's lower bound LB_i, i.e.
    extra steps x T_i^min, over k' - k. Ties go to the earlier deadline, then to the order of
    `requests`. Entries of `degrees_now` for ids not in `requests` are kept as they are.
    Requests absent from `degrees_now` with the same resolution and remaining steps have the
    same upgrades, so they queue by (deadline, order) per class (`scale_up`).
    """
    if num_devices - sum(degrees_now.values()) <= 0:
        return dict(degrees_now)
    running = [(i, r) for i, r in enumerate(requests) if r.request_id in degrees_now]
    classes: dict[tuple[Hashable, int], list[tuple[float, int]]] = {}
    for i, r in enumerate(requests):
        if r.request_id not in degrees_now:
            classes.setdefault((r.resolution, r.remaining_steps), []).append((r.deadline, i))
    queues = [((i, requests[i]) for _, i in sorted(members)) for members in classes.values()]
    return scale_up(degrees_now, running, queues, step_time, tau, num_devices)


def scale_up(
    degrees_now: Mapping[str, int],
    running: Sequence[tuple[Any, RoundRequest]],
    queues: Sequence[Iterator[tuple[Any, RoundRequest]]],
    step_time: StepTime,
    tau: float,
    num_devices: int,
) -> dict[str, int]:
    """`elastic_scale_up` over `running`, (order, request) of requests in `degrees_now` it may
    upgrade, and `queues`, one per class of requests absent from it with the same resolution
    and remaining steps, each giving (order, request) by (deadline, order) as it is read.
    Orders are unique and comparable across all of them: ties of benefit and deadline go to
    the lesser.

    Only a class's head is in the heap; the next takes its place when it is started. The heap
    is lazy: an entry computed when more devices were idle is looked at again when popped.
    O((C + N) log C) step-time look-ups and heap operations for C classes and running
    requests: at most N upgrades happen.
    """
    step_time, out = cached(step_time), dict(degrees_now)
    idle = num_devices - sum(out.values())
    if idle <= 0:
        return out
    top = max_degree(num_devices)
    heap: list[tuple] = []  # (-benefit, deadline, order, from k, to k', request, its queue or None)

    def push(order, request: RoundRequest, queue) -> None:
        k = out.get(request.request_id, 0)
        best = _best_upgrade(request, k, idle, step_time, tau, top)
        if best is not None:
            heapq.heappush(heap, (-best[0], request.deadline, order, k, best[1], request, queue))

    def push_head(queue) -> None:
        head = next(queue, None)
        if head is not None:
            push(*head, queue)

    for order, request in running:
        push(order, request, None)
    for queue in queues:
        push_head(queue)
    while heap and idle > 0:
        _, _, order, k, k_new, request, queue = heapq.heappop(heap)
        if k_new - k > idle:  # fewer idle devices than when it was pushed: look again
            push(order, request, queue)
            continue
        starts = request.request_id not in out  # the head of its class: the next in line moves up
        out[request.request_id] = k_new
        idle -= k_new - k
        push(order, request, queue)
        if starts and queue is not None:
            push_head(queue)
    return out


def _best_upgrade(
    request: RoundRequest, k: int, idle: int, step_time: StepTable, tau: float, top: int
) -> tuple[float, int] | None:
    """(benefit per extra device, k') of the request's best upgrade from k, or None."""
    s = request.remaining_steps
    q_now = steps_in_round(step_time(request.resolution, k), tau, s) if k else 0
    if q_now == s:
        return None  # finishes this round already
    row = step_time.row(request.resolution, top)
    best: tuple[float, int] | None = None
    for k_new, t in row.times:
        if k_new <= k or k_new - k > idle:
            continue
        gain = steps_in_round(t, tau, s) - q_now
        benefit = gain * row.fastest / (k_new - k)
        if gain > 0 and (best is None or benefit > best[0]):
            best = (benefit, k_new)
    return best
