"""`plan_round` as first written (before the fast paths), kept as the reference that the fast
version must match decision for decision. Every request gets its deadline plan and options,
elastic scale-up pushes every request, and lateness is tested per request. Slow and plain."""

from __future__ import annotations

import heapq
import math

from gouache.sched.group_knapsack import group_knapsack
from gouache.sched.placement import place
from gouache.sched.rounds import (
    Allocation,
    RoundAllocation,
    RoundDecision,
    RoundOption,
    degrees,
    max_degree,
    steps_in_round,
    survives,
)


def t_min_of(request, step_time, top):
    return min(step_time(request.resolution, k) for k in degrees(top))


def deadline_allocations(request, step_time, now, max_degree):
    s, deadline = request.remaining_steps, request.deadline
    times = {k: step_time(request.resolution, k) for k in degrees(max_degree)}
    cheapest = min(times, key=lambda k: (k * times[k], k))
    if now + s * times[cheapest] <= deadline:
        return [Allocation(s, cheapest)]
    best = None
    for slow, t_slow in times.items():
        if now + s * t_slow <= deadline:
            best = _better(best, (s * slow * t_slow, 1, slow, [Allocation(s, slow)]))
        for fast, t_fast in times.items():
            if t_fast >= t_slow:
                continue
            fast_steps = (now + s * t_slow - deadline) / (t_slow - t_fast)
            if not 0 < fast_steps <= s - 1:
                continue
            x = math.ceil(fast_steps)
            while x < s and now + (s - x) * t_slow + x * t_fast > deadline:
                x += 1
            if x < s:
                plan = sorted([Allocation(s - x, slow), Allocation(x, fast)], key=lambda a: a.degree)
                best = _better(best, ((s - x) * slow * t_slow + x * fast * t_fast, 2, max(slow, fast), plan))
    return best[3] if best else None


def _better(best, new):
    return new if best is None or new[:3] < best[:3] else best


def round_options(request, plan, step_time, now, tau, num_devices):
    t_min = t_min_of(request, step_time, max_degree(num_devices))
    options = [RoundOption(0, 0, survives(request, 0, 0.0, t_min, tau, now))]
    for part in plan:
        if part.degree > num_devices:
            continue
        t = step_time(request.resolution, part.degree)
        q = steps_in_round(t, tau, part.steps)
        if q > 0:
            options.append(RoundOption(part.degree, q, survives(request, q, t, t_min, tau, now)))
    return options


def elastic_scale_up(degrees_now, requests, step_time, tau, num_devices):
    out = dict(degrees_now)
    idle = num_devices - sum(out.values())
    top = max_degree(num_devices)
    heap = []

    def push(i):
        request = requests[i]
        k = out.get(request.request_id, 0)
        best = _best_upgrade(request, k, idle, step_time, tau, top)
        if best is not None:
            heapq.heappush(heap, (-best[0], request.deadline, i, k, best[1]))

    for i in range(len(requests)):
        push(i)
    while heap and idle > 0:
        _, _, i, k, k_new = heapq.heappop(heap)
        if k_new - k > idle:
            push(i)
            continue
        out[requests[i].request_id] = k_new
        idle -= k_new - k
        push(i)
    return out


def _best_upgrade(request, k, idle, step_time, tau, top):
    s = request.remaining_steps
    q_now = steps_in_round(step_time(request.resolution, k), tau, s) if k else 0
    if q_now == s:
        return None
    t_min = t_min_of(request, step_time, top)
    best = None
    for k_new in degrees(top):
        if k_new <= k or k_new - k > idle:
            continue
        gain = steps_in_round(step_time(request.resolution, k_new), tau, s) - q_now
        benefit = gain * t_min / (k_new - k)
        if gain > 0 and (best is None or benefit > best[0]):
            best = (benefit, k_new)
    return best


def selective_batching(degrees_now, requests, step_time, batch_step_time, tau, now, num_devices, max_batch=8,
                       allow_late=True):
    top = max_degree(num_devices)
    groups = {}
    for request in requests:
        if degrees_now.get(request.request_id) == 1:
            groups.setdefault(request.resolution, []).append([request])
    members_ok = {}
    joiners = sorted((r for r in requests if r.request_id not in degrees_now), key=lambda r: r.deadline)
    for joiner in joiners:
        for group in sorted(groups.get(joiner.resolution, ()), key=len):
            if len(group) >= max_batch:
                continue
            t_old = batch_step(joiner.resolution, len(group), step_time, batch_step_time)
            t_new = batch_step(joiner.resolution, len(group) + 1, step_time, batch_step_time)
            if t_new / (len(group) + 1) >= t_old / len(group):
                continue
            done = steps_in_round(t_new, tau, joiner.remaining_steps)
            t_min = t_min_of(joiner, step_time, top)
            if done == 0 or not (allow_late or survives(joiner, done, t_new, t_min, tau, now)):
                continue
            if id(group) not in members_ok:
                members_ok[id(group)] = all(_keeps_outlook(m, t_old, t_new, step_time, tau, now, top) for m in group)
            if members_ok[id(group)]:
                group.append(joiner)
                del members_ok[id(group)]
                break
    return [[m.request_id for m in g] for gs in groups.values() for g in gs if len(g) > 1]


def batch_step(resolution, size, step_time, batch_step_time):
    return step_time(resolution, 1) if size == 1 else batch_step_time(resolution, size)


def _keeps_outlook(member, t_old, t_new, step_time, tau, now, top):
    before = steps_in_round(t_old, tau, member.remaining_steps)
    after = steps_in_round(t_new, tau, member.remaining_steps)
    return _outlook(member, after, t_new, step_time, tau, now, top) <= _outlook(
        member, before, t_old, step_time, tau, now, top
    )


def _outlook(request, done, step_s, step_time, tau, now, top):
    left = request.remaining_steps - done
    if left == 0:
        return 0 if now + done * step_s <= request.deadline else math.inf
    for k in degrees(top):
        if now + tau + left * step_time(request.resolution, k) <= request.deadline:
            return k
    return math.inf


def plan_round(requests, step_time, num_devices, tau, now, previous_placement=None, *, batch_step_time=None,
               max_batch=8, run_late=True):
    ordered = sorted(requests, key=lambda r: r.deadline)
    top = max_degree(num_devices)
    options = []
    for request in ordered:
        plan = deadline_allocations(request, step_time, now, top)
        if plan is None:
            fastest = min(degrees(top), key=lambda k: (step_time(request.resolution, k), k))
            plan = [Allocation(request.remaining_steps, fastest)]
        options.append(round_options(request, plan, step_time, now, tau, num_devices))
    chosen = [opts[0] for opts in options]
    urgent = [i for i, opts in enumerate(options) if not opts[0].survives and any(o.survives for o in opts)]
    for i, j in zip(urgent, group_knapsack([options[i] for i in urgent], num_devices)):
        chosen[i] = options[i][j]

    degree = {r.request_id: o.degree for r, o in zip(ordered, chosen) if o.degree}
    degree = elastic_scale_up(degree, [r for r, o in zip(ordered, chosen) if o.survives], step_time, tau, num_devices)
    if run_late:
        doomed = [r for r, o in zip(ordered, chosen) if not o.survives]
        degree = elastic_scale_up(degree, doomed, step_time, tau, num_devices)
    by_id = {r.request_id: r for r in ordered}
    host = {rid: rid for rid in degree}
    step_s = {rid: step_time(by_id[rid].resolution, k) for rid, k in degree.items()}
    batches = []
    if batch_step_time is not None:
        batches = selective_batching(degree, ordered, step_time, batch_step_time, tau, now, num_devices, max_batch,
                                     run_late)
        for group in batches:
            t = batch_step(by_id[group[0]].resolution, len(group), step_time, batch_step_time)
            host.update((rid, group[0]) for rid in group)
            step_s.update((rid, t) for rid in group)
    devices = place(degree, previous_placement or {}, num_devices)
    allocations = {
        rid: RoundAllocation(devices[host[rid]], steps_in_round(t, tau, by_id[rid].remaining_steps))
        for rid, t in step_s.items()
    }
    late = []
    for r in ordered:
        allocation = allocations.get(r.request_id)
        done = allocation.steps if allocation else 0
        if not survives(r, done, step_s.get(r.request_id, 0.0), t_min_of(r, step_time, top), tau, now):
            late.append(r.request_id)
    return RoundDecision(allocations=allocations, batches=batches, late=late)
