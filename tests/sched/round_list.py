"""`plan_round` as it was before it read requests by class (`round_classes`): every request
sorted by (tier, deadline), each triaged in O(1), options for the urgent ones, the tier weights
(R + 1)^(tiers below). Kept as the reference the class-reading planner must match on rounds
with service tiers, which `round_reference` (written before tiers) does not have."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter

from gouache.sched.batching import batch_step, selective_batching
from gouache.sched.deadline_plans import deadline_allocations, round_options
from gouache.sched.deadline_plans import fastest_degree as _fastest
from gouache.sched.elastic import elastic_scale_up
from gouache.sched.group_knapsack import group_knapsack
from gouache.sched.knapsack import _Bounds, _late  # the helpers the list version shares with the planner today
from gouache.sched.placement import place
from gouache.sched.rounds import (
    Allocation,
    BatchStepTime,
    RoundAllocation,
    RoundDecision,
    RoundOption,
    RoundRequest,
    StepTable,
    StepTime,
    cached,
    max_degree,
    steps_in_round,
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
    above any number of a lower tier's (`tier_weights`).
    The DP runs on the urgent requests only: those that survive without running ("none" has
    sv = 1) or cannot survive whatever they get take "none" in some optimal choice, and
    leaving them out gives the same optimum (the paper: "to decide which requests must be
    scheduled now"); they are told apart in O(1) each (`_knapsack_choice`). Idle devices
    then go to the surviving requests (elastic scale-up), then, if `run_late`, to the rest
    best-effort; requests still without devices may batch with a same-resolution one-device
    request when `batch_step_time` is given. A scheduled request runs floor(τ / T) steps
    (capped by what it has left), not the DP's q_i^m: doing more of its work early never
    hurts its deadline. Requests that are definitely late under the final plan are listed in
    `late` for the caller to drop or keep.
    """
    by_id = _index(requests, num_devices, tau, max_batch)
    cost = cached(step_time)
    ordered = sorted(requests, key=attrgetter("tier", "deadline"))
    chosen, degree, unsure = _knapsack_choice(ordered, cost, num_devices, tau, now)
    if sum(degree.values()) < num_devices:  # else scale-up has nothing to hand out
        degree = elastic_scale_up(degree, [r for r, o in zip(ordered, chosen) if o.survives], cost, tau, num_devices)
    if run_late and sum(degree.values()) < num_devices:
        doomed = [ordered[i] for i in unsure if not chosen[i].survives]
        degree = elastic_scale_up(degree, doomed, cost, tau, num_devices)
    host = {rid: rid for rid in degree}  # whose devices each running request uses
    step_s = {rid: cost(by_id[rid].resolution, k) for rid, k in degree.items()}  # seconds per step
    batches: list[list[str]] = []
    if batch_step_time is not None:
        batches = selective_batching(degree, ordered, cost, batch_step_time, tau, now, num_devices, max_batch, run_late)
        for group in batches:
            t = batch_step(by_id[group[0]].resolution, len(group), cost, batch_step_time)
            host.update((rid, group[0]) for rid in group)
            step_s.update((rid, t) for rid in group)
    devices = place(degree, previous_placement or {}, num_devices)
    allocations = {
        rid: RoundAllocation(devices[host[rid]], steps_in_round(t, tau, by_id[rid].remaining_steps))
        for rid, t in step_s.items()
    }
    late = _late_ids(ordered, chosen, unsure, allocations, step_s, cost, tau, now, max_degree(num_devices))
    return RoundDecision(allocations=allocations, batches=batches, late=late)


def _late_ids(ordered: Sequence[RoundRequest], chosen: Sequence[RoundOption], unsure: list[int],
              allocations: Mapping[str, RoundAllocation], step_s: Mapping[str, float], cost: StepTable,
              tau: float, now: float, top: int) -> list[str]:
    """The ids definitely late at t_{r+1} under the final plan, in deadline order.

    Only the `unsure` requests (those whose "none" does not survive) can be late. One whose
    "none" survives is not late if it idles, and if it runs q steps it has fewer left, or
    finishes by now + q x T <= t_{r+1}. Of the unsure, one that does not run is late iff its
    knapsack option (a "none" unless it runs) does not survive; one that runs is tested again
    with the steps it got.
    """
    late = []
    for i in unsure:
        request = ordered[i]
        allocation = allocations.get(request.request_id)
        if allocation is None:
            if not chosen[i].survives:
                late.append(request.request_id)
        elif _late(request, allocation.steps, step_s[request.request_id], cost, tau, now, top):
            late.append(request.request_id)
    return late


def _knapsack_choice(
    ordered: Sequence[RoundRequest], cost: StepTable, num_devices: int, tau: float, now: float
) -> tuple[list[RoundOption], dict[str, int], list[int]]:
    """Algorithm 1 over the urgent requests: the option each request takes before scale-up,
    the degree of each request it runs (by id), and the indices of the requests whose "none"
    does not survive, ascending.

    A request takes "none" without its options (O(|K|^2) to build) when "none" survives, and
    when no option can save it. With T_min its fastest step and q_cap = floor(τ / T_min), an
    option runs q <= min(s, q_cap) steps of T >= T_min seconds. Unfinished (q < s), it
    survives iff t_{r+1} + (s - q) x T_min <= D: at best with s - q = max(s - q_cap, 1) steps
    left. Finishing (q = s, so q_cap >= s), iff now + s x T <= D: at best with T = T_min. If
    neither best case survives, no option does (float rounding is monotone, so this holds as
    computed). The rest get options as Algorithm 1 writes them; those some option saves
    enter the DP. (A numpy version of these two tests was no faster at 1,000 requests.)
    """
    top = max_degree(num_devices)
    end = now + tau  # t_{r+1}
    bounds = _Bounds(cost, top, tau)
    chosen = [_WAITS] * len(ordered)
    unsure: list[int] = []  # indices whose "none" does not survive
    urgent: list[int] = []  # indices of the DP's groups
    groups: list[list[RoundOption]] = []
    for i, request in enumerate(ordered):
        t_min, q_cap = bounds[request.resolution]
        s, deadline = request.remaining_steps, request.deadline
        if s < 1:
            raise ValueError(f"{request.request_id}: remaining_steps must be >= 1 (finished requests leave the round)")
        if end + s * t_min <= deadline:  # "none" survives, as rounds.survives(request, 0, 0.0, t_min, tau, now)
            continue
        unsure.append(i)
        fewest_left = s - q_cap if s > q_cap else 1  # steps left after the longest unfinished option
        can_finish = q_cap >= s and now + s * t_min <= deadline
        if end + fewest_left * t_min > deadline and not can_finish:
            chosen[i] = _LOST
            continue
        plan = deadline_allocations(request, cost, now, top)
        if plan is None:  # hopeless: its one allocation is the fastest degree, for best effort
            plan = [Allocation(s, _fastest(request, cost, top))]
        options = round_options(request, plan, cost, now, tau, num_devices)
        if any(o.survives for o in options):
            urgent.append(i)
            groups.append(options)
        chosen[i] = options[0]
    running = {}
    weights = tier_weights([ordered[i].tier for i in urgent])
    for i, options, j in zip(urgent, groups, group_knapsack(groups, num_devices, weights)):
        chosen[i] = options[j]
        if options[j].degree:
            running[ordered[i].request_id] = options[j].degree
    return chosen, running, unsure


def tier_weights(tiers: Sequence[int]) -> list[int] | None:
    """What one survivor of each request's tier counts in the DP: (n + 1)^(tiers below it) for
    n requests, so one survivor of a tier outranks all of the tiers below; None (all count 1)
    when all share a tier."""
    if len(set(tiers)) <= 1:
        return None
    lowest, base = max(tiers), len(tiers) + 1
    return [base ** (lowest - tier) for tier in tiers]


_WAITS = RoundOption(0, 0, True)  # "none", and the request survives it
_LOST = RoundOption(0, 0, False)  # "none", and no option would save the request


def _index(requests: Sequence[RoundRequest], num_devices: int, tau: float, max_batch: int) -> dict[str, RoundRequest]:
    """id -> request, after checking the round's arguments."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not tau > 0:
        raise ValueError(f"the round length tau must be > 0 seconds, got {tau}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    by_id = {r.request_id: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique within a round")
    return by_id
