import itertools
import math
import random

import pytest

from gouache.sched.batching import selective_batching
from gouache.sched.deadline_plans import deadline_allocations, minimal_feasible_degree, round_options
from gouache.sched.elastic import elastic_scale_up
from gouache.sched.group_knapsack import Knapsack, group_knapsack
from gouache.sched.knapsack import plan_round
from gouache.sched.placement import place
from gouache.sched.rounds import RoundOption, RoundRequest

from . import round_reference as reference

# Seconds per step by resolution and degree, shaped like the paper's Fig. 2: small images scale poorly.
TABLE = {
    256: {1: 0.05, 2: 0.04, 4: 0.035, 8: 0.035},
    512: {1: 0.10, 2: 0.065, 4: 0.05, 8: 0.045},
    1024: {1: 0.40, 2: 0.22, 4: 0.13, 8: 0.08},
    2048: {1: 1.60, 2: 0.85, 4: 0.45, 8: 0.26},
}


def step_time(resolution, k):
    return TABLE[resolution][k]


def batch_time(resolution, b):
    """Batching amortises half of a step's cost: B(b) = T(1) x (0.5 + 0.5 b)."""
    return TABLE[resolution][1] * (0.5 + 0.5 * b)


def req(rid, res=1024, steps=20, deadline=math.inf):
    return RoundRequest(rid, res, steps, deadline)


def assert_valid(plan, requests, num_devices):
    by_id = {r.request_id: r for r in requests}
    members = {rid for group in plan.batches for rid in group[1:]}
    used = [d for rid, a in plan.allocations.items() if rid not in members for d in a.devices]
    assert len(used) == len(set(used)) and all(0 <= d < num_devices for d in used)
    for rid, a in plan.allocations.items():
        k = len(a.devices)
        assert k & (k - 1) == 0 and a.devices[0] % k == 0 and a.devices == tuple(range(a.devices[0], a.devices[0] + k))
        assert a.steps >= 1 and a.steps <= by_id[rid].remaining_steps
    for group in plan.batches:
        assert len(group) >= 2 and len({by_id[rid].resolution for rid in group}) == 1
        assert len({plan.allocations[rid].devices for rid in group}) == 1


# -- group-knapsack DP ------------------------------------------------------------------------


def brute_force(groups, capacity):
    """(most survivors, fewest devices among those) over every combination of options."""
    best = None
    for combo in itertools.product(*(range(len(g)) for g in groups)):
        width = sum(g[j].width for g, j in zip(groups, combo))
        if width <= capacity:
            key = (sum(g[j].value for g, j in zip(groups, combo)), -width)
            best = key if best is None or key > best else best
    return best


def random_groups(rng, capacity):
    groups = []
    for _ in range(rng.randint(0, 6)):
        group = [RoundOption(0, 0, rng.random() < 0.4)]
        for _ in range(rng.randint(0, 3)):
            width = rng.choice([1, 2, 4, 8, rng.randint(1, capacity + 2)])
            group.append(RoundOption(width, rng.randint(1, 9), rng.random() < 0.6))
        groups.append(group)
    return groups


def test_group_knapsack_equals_brute_force_on_random_cases():
    rng = random.Random(7)
    for _ in range(300):
        capacity = rng.randint(1, 8)
        groups = random_groups(rng, capacity)
        choice = group_knapsack(groups, capacity)
        picked = [g[j] for g, j in zip(groups, choice)]
        assert len(choice) == len(groups)
        assert sum(o.width for o in picked) <= capacity
        assert (sum(o.value for o in picked), -sum(o.width for o in picked)) == brute_force(groups, capacity)


def test_group_knapsack_needs_a_choice_that_fits():
    assert group_knapsack([], 4) == []
    with pytest.raises(ValueError):
        group_knapsack([[RoundOption(8, 1, True)]], 4)


def test_plan_round_keeps_the_brute_force_optimum_alive():
    """Running the DP on urgent requests only loses nothing, and scale-up kills no survivor."""
    rng = random.Random(11)
    for _ in range(150):
        n = rng.choice([1, 2, 4, 8])
        tau, now = rng.choice([0.5, 1.0, 2.0]), rng.uniform(0, 10)
        requests = [
            req(f"r{i}", rng.choice(list(TABLE)), rng.randint(1, 30), now + rng.uniform(0.1, 12))
            for i in range(rng.randint(1, 6))
        ]
        groups = []
        for r in requests:
            plan = deadline_allocations(r, step_time, now, n) or []  # hopeless: no option can survive anyway
            groups.append(round_options(r, plan, step_time, now, tau, n))
        result = plan_round(requests, step_time, n, tau, now, run_late=False)
        assert_valid(result, requests, n)
        assert len(requests) - len(result.late) == brute_force(groups, n)[0]
        assert not set(result.late) & set(result.allocations)


# -- deadline-aware allocation ----------------------------------------------------------------


def test_minimal_feasible_degree_hand_made():
    def r(deadline):  # 20 steps of 1024: 8.0 / 4.4 / 2.6 / 1.6 s on 1 / 2 / 4 / 8 devices
        return req("a", 1024, 20, deadline)

    assert minimal_feasible_degree(r(10.0), step_time, 0.0, 8) == 1
    assert minimal_feasible_degree(r(5.0), step_time, 0.0, 8) == 2
    assert minimal_feasible_degree(r(3.0), step_time, 0.0, 8) == 4
    assert minimal_feasible_degree(r(2.0), step_time, 0.0, 8) == 8
    assert minimal_feasible_degree(r(1.5), step_time, 0.0, 8) is None
    assert minimal_feasible_degree(r(2.0), step_time, 0.0, 4) is None  # degree 8 is beyond max_degree
    assert minimal_feasible_degree(r(105.0), step_time, 100.0, 8) == 2  # the budget is deadline - now


def test_minimal_feasible_degree_prefers_least_device_time():
    superlinear = {1: 1.0, 2: 0.4, 4: 0.3}  # two devices take 0.8 device-s per step, one takes 1.0
    k = minimal_feasible_degree(req("a", "x", 10, 100.0), lambda _, k: superlinear[k], 0.0, 4)
    assert k == 2


def brute_force_plan_cost(r, now, top):
    ks = [k for k in (1, 2, 4, 8) if k <= top]
    best = math.inf
    for split in itertools.product(range(r.remaining_steps + 1), repeat=len(ks) - 1):
        last = r.remaining_steps - sum(split)
        if last < 0:
            continue
        counts = (*split, last)
        if now + sum(c * step_time(r.resolution, k) for c, k in zip(counts, ks)) <= r.deadline:
            best = min(best, sum(c * k * step_time(r.resolution, k) for c, k in zip(counts, ks)))
    return best


def test_deadline_allocations_mix_two_degrees_to_just_meet_the_deadline():
    plan = deadline_allocations(req("a", 1024, 20, 6.0), step_time, 0.0, 8)
    # 2 alone: 4.4 s for 8.8 device-s; 8 steps on 1 and 12 on 2: 5.84 s for 8.48 device-s
    assert [(a.steps, a.degree) for a in plan] == [(8, 1), (12, 2)]
    assert deadline_allocations(req("a", 1024, 20, 1.5), step_time, 0.0, 8) is None


def test_deadline_allocations_feasible_and_near_optimal_against_brute_force():
    rng = random.Random(3)
    for _ in range(120):
        top = rng.choice([1, 2, 4, 8])
        r = req("a", rng.choice(list(TABLE)), rng.randint(1, 8), rng.uniform(0.05, 12))
        plan, best = deadline_allocations(r, step_time, 0.0, top), brute_force_plan_cost(r, 0.0, top)
        assert (plan is None) == math.isinf(best)
        if plan:
            assert sum(a.steps for a in plan) == r.remaining_steps
            assert sum(a.steps * step_time(r.resolution, a.degree) for a in plan) <= r.deadline
            cost = sum(a.steps * a.degree * step_time(r.resolution, a.degree) for a in plan)
            assert cost <= best + max(k * step_time(r.resolution, k) for k in (1, 2, 4, 8) if k <= top) + 1e-9


# -- placement --------------------------------------------------------------------------------


def test_place_keeps_devices_of_unchanged_degrees():
    previous = {"a": (0, 1), "b": (5,), "c": (4,)}
    assert place({"a": 2, "b": 1, "c": 1}, previous, 8) == previous
    # a newcomer that needs a block of 4 goes where nobody was, not onto a's devices
    assert place({"a": 2, "n": 4}, {"a": (2, 3)}, 8) == {"n": (4, 5, 6, 7), "a": (2, 3)}


def test_place_resizes_over_previous_devices():
    assert place({"a": 2}, {"a": (4, 5, 6, 7)}, 8) == {"a": (4, 5)}
    assert place({"a": 4}, {"a": (2, 3)}, 8) == {"a": (0, 1, 2, 3)}


def random_degrees(rng, n):
    degrees, free = {}, n
    for i in range(8):
        fitting = [k for k in (1, 2, 4, 8) if k <= free]
        if fitting and rng.random() < 0.8:
            degrees[f"r{i}"] = k = rng.choice(fitting)
            free -= k
    return degrees


def assert_placed(placement, degrees, n):
    used = [d for devices in placement.values() for d in devices]
    assert len(used) == len(set(used)) and all(0 <= d < n for d in used)
    for rid, k in degrees.items():
        devices = placement[rid]
        assert len(devices) == k and devices == tuple(range(devices[0], devices[0] + k)) and devices[0] % k == 0


def test_place_always_fits_and_keeps_unchanged_degrees():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.choice([1, 2, 3, 4, 6, 8])
        degrees = random_degrees(rng, n)
        first = place(degrees, {}, n)
        assert_placed(first, degrees, n)
        kept = {rid: k for rid, k in degrees.items() if rng.random() < 0.7}
        if sum(kept.values()) < n:
            kept["new"] = 1
        second = place(kept, first, n)
        assert_placed(second, kept, n)
        assert all(second[rid] == first[rid] for rid in kept if rid != "new")
        resized = random_degrees(rng, n)  # same ids, new degrees: must still fit
        assert_placed(place(resized, first, n), resized, n)


# -- elastic scale-up ---------------------------------------------------------------------------


def test_elastic_scale_up_gives_idle_devices_to_a_running_request():
    big = req("big", 2048, 40, 100.0)
    assert elastic_scale_up({"big": 2}, [big], step_time, 2.0, 8) == {"big": 8}


def test_elastic_scale_up_starts_waiting_requests_and_leaves_finishing_ones():
    small = [req(f"s{i}", 256, 5, 100.0) for i in range(3)]  # 5 steps x 0.05 s fit one round at degree 1
    out = elastic_scale_up({}, small, step_time, 1.0, 8)
    assert out == {"s0": 1, "s1": 1, "s2": 1}
    assert elastic_scale_up({"s0": 1}, small[:1], step_time, 1.0, 8) == {"s0": 1}


def test_elastic_scale_up_never_exceeds_the_devices():
    rng = random.Random(2)
    for _ in range(50):
        requests = [req(f"r{i}", rng.choice(list(TABLE)), rng.randint(1, 50), 100.0) for i in range(6)]
        out = elastic_scale_up({}, requests, step_time, rng.choice([0.5, 1.0, 2.0]), 8)
        assert sum(out.values()) <= 8


# -- plan_round ---------------------------------------------------------------------------------


def test_a_lone_request_with_a_loose_deadline_still_runs():
    plan = plan_round([req("a", 2048, 50, 1000.0)], step_time, 8, 2.0, 0.0)
    assert plan.allocations["a"].devices == tuple(range(8)) and plan.late == []


def test_urgent_requests_get_the_devices():
    loose, urgent = req("loose", 1024, 20, 100.0), req("urgent", 1024, 20, 8.5)  # 8.0 s on one device
    plan = plan_round([loose, urgent], step_time, 1, 1.0, 0.0)
    assert list(plan.allocations) == ["urgent"] and plan.late == []


def test_contention_makes_one_request_late_and_best_effort_is_optional():
    # with N = 2, each would be definitely late without a round now (1 + 20 x 0.22 > 5), and one device saves it
    requests = [req(f"r{i}", 1024, 20, 5.0 + i * 0.01) for i in range(3)]
    plan = plan_round(requests, step_time, 2, 1.0, 0.0, run_late=False)
    assert sorted(plan.allocations) == ["r0", "r1"] and plan.late == ["r2"]


def test_hopeless_requests_are_late_and_run_only_best_effort():
    hopeless = req("h", 2048, 50, 1.0)
    assert plan_round([hopeless], step_time, 8, 1.0, 0.0, run_late=False).allocations == {}
    plan = plan_round([hopeless], step_time, 8, 1.0, 0.0)
    assert plan.late == ["h"] and len(plan.allocations["h"].devices) == 8


def test_placement_is_preserved_from_round_to_round():
    requests = [req("a", 1024, 40, 12.0), req("b", 2048, 40, 20.0), req("c", 256, 40, 30.0)]
    first = plan_round(requests, step_time, 8, 1.0, 0.0)
    previous = {rid: a.devices for rid, a in first.allocations.items()}
    moved = [RoundRequest(r.request_id, r.resolution, r.remaining_steps - first.allocations[r.request_id].steps,
                          r.deadline) for r in requests]
    second = plan_round(moved, step_time, 8, 1.0, 1.0, previous)
    for rid, a in second.allocations.items():
        if len(a.devices) == len(previous[rid]):
            assert a.devices == previous[rid]


# -- selective batching -------------------------------------------------------------------------


def test_small_requests_batch_when_no_slo_suffers():
    host, joiner = req("h", 256, 30, 10.0), req("j", 256, 30, 10.0)
    plan = plan_round([host, joiner], step_time, 1, 0.5, 0.0, batch_step_time=batch_time)
    assert plan.batches == [["h", "j"]]
    assert plan.allocations["h"].devices == plan.allocations["j"].devices == (0,)
    assert plan.allocations["h"].steps == 6  # floor(0.5 / 0.075), instead of 10 alone
    assert plan_round([host, joiner], step_time, 1, 0.5, 0.0).batches == []  # no batch cost model


def test_no_batch_when_the_host_would_need_more_devices_later():
    # alone, h leaves 20 steps = 1.0 s at degree 1 by 1.54; batched it would leave 24 and need degree 2
    host, joiner = req("h", 256, 30, 1.54), req("j", 256, 30, 10.0)
    plan = plan_round([host, joiner], step_time, 1, 0.5, 0.0, batch_step_time=batch_time)
    assert plan.batches == [] and list(plan.allocations) == ["h"] and plan.late == []


def test_no_batch_across_resolutions_or_without_a_throughput_gain():
    host = req("h", 256, 30, 10.0)
    assert selective_batching({"h": 1}, [host, req("j", 512, 30, 10.0)], step_time, batch_time, 0.5, 0.0, 1) == []
    def linear(res, b):  # a batch of b costs b single steps
        return TABLE[res][1] * b

    assert selective_batching({"h": 1}, [host, req("j", 256, 30, 10.0)], step_time, linear, 0.5, 0.0, 1) == []
    assert selective_batching({"h": 2}, [host, req("j", 256, 30, 10.0)], step_time, batch_time, 0.5, 0.0, 2) == []


# -- scale and purity ---------------------------------------------------------------------------


def test_a_round_over_a_thousand_requests():
    rng = random.Random(1)
    requests = [req(f"r{i}", rng.choice(list(TABLE)), rng.randint(1, 50), rng.uniform(0.5, 60)) for i in range(1000)]
    plan = plan_round(requests, step_time, 8, 1.0, 0.0, batch_step_time=batch_time)
    assert_valid(plan, requests, 8)
    assert plan.allocations and len(plan.late) < len(requests)


def test_a_finished_request_is_refused():
    with pytest.raises(ValueError, match="r2: remaining_steps must be >= 1"):
        plan_round([req("r1"), req("r2", steps=0)], step_time, 8, 1.0, 0.0)


# -- the fast paths decide exactly as the plain algorithm ---------------------------------------
# `round_reference` is plan_round as first written: options for every request, a heap of every
# request in scale-up, lateness tested per request. The fast one must match it on every case.


# Step times that do not fall with the degree everywhere (communication outgrows the split work),
# so a "faster" degree can be a smaller one.
ODD = {
    256: {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.09},
    512: {1: 0.10, 2: 0.06, 4: 0.07, 8: 0.05},
    1024: {1: 0.40, 2: 0.22, 4: 0.25, 8: 0.12},
    2048: {1: 1.60, 2: 0.85, 4: 0.45, 8: 0.50},
}


def odd_step_time(resolution, k):
    return ODD[resolution][k]


def boundary_deadline(rng, res, steps, tau, now, n, step_time=step_time):
    """A deadline on or next to one of the round's survival thresholds, where rounding bites."""
    t_min = min(step_time(res, k) for k in (1, 2, 4, 8) if k <= n)
    q = rng.choice([rng.randint(0, steps), math.floor(tau / t_min + 1e-9)])  # any, or the most a round holds
    threshold = rng.choice([now + tau + steps * t_min, now + steps * t_min, now + tau + max(steps - q, 1) * t_min,
                            now + steps * step_time(res, 1)])
    return threshold + rng.choice([0.0, 0.0, 1e-12, -1e-12, 1e-9, -1e-9])


def random_round(rng, size=None, step_time=step_time):
    n = rng.choice([1, 2, 3, 4, 6, 8])
    tau, now = rng.choice([0.3, 0.5, 1.0, 2.0]), rng.choice([0.0, 7.3, rng.uniform(0, 100)])
    requests = []
    for i in range(size if size is not None else rng.randint(1, 60)):
        res, steps = rng.choice(list(TABLE)), rng.choice([1, 2, 5, 20, 30, rng.randint(1, 50)])
        deadline = rng.choice([
            now + rng.uniform(0.05, 15), now + rng.uniform(0.05, 15), math.inf,
            boundary_deadline(rng, res, steps, tau, now, n, step_time),
            requests[-1].deadline if requests else now + 1.0,  # a tie with the one before
        ])
        requests.append(req(f"r{i}", res, steps, deadline))
    rng.shuffle(requests)
    return requests, n, tau, now


def test_plan_round_decides_as_the_reference_on_random_rounds():
    rng = random.Random(23)
    for case in range(400):
        cost = rng.choice([step_time, odd_step_time])
        requests, n, tau, now = random_round(rng, step_time=cost)
        kwargs = {"batch_step_time": rng.choice([None, batch_time]), "max_batch": rng.choice([2, 8]),
                  "run_late": rng.random() < 0.7}
        first = plan_round(requests, cost, n, tau, now, **kwargs)
        assert first == reference.plan_round(requests, cost, n, tau, now, **kwargs), case
        previous = {rid: a.devices for rid, a in first.allocations.items()}
        later = now + tau / 2
        assert plan_round(requests, cost, n, tau, later, previous, **kwargs) == reference.plan_round(
            requests, cost, n, tau, later, previous, **kwargs), case


def test_plan_round_decides_as_the_reference_on_the_benchmark_round():
    """The overhead benchmark's round: 1,000 FLUX requests on 8 H100s, most of them not urgent."""
    from gouache.bench.overhead import round_case

    requests, model, tau, now = round_case(1_000)
    plan = plan_round(requests, model.seconds, 8, tau, now)
    assert plan == reference.plan_round(requests, model.seconds, 8, tau, now)
    assert 0 < len(plan.late) < len(requests)


def test_deadline_allocations_equal_the_reference():
    rng = random.Random(29)
    for _ in range(2000):
        cost = rng.choice([step_time, odd_step_time])
        requests, n, tau, now = random_round(rng, size=1, step_time=cost)
        top = rng.choice([1, 2, 4, 8])
        assert deadline_allocations(requests[0], cost, now, top) == reference.deadline_allocations(
            requests[0], cost, now, top)


def test_elastic_scale_up_equals_the_reference():
    """Requests in any order, many of one (resolution, steps) class, with tied deadlines."""
    rng = random.Random(31)
    for case in range(600):
        cost = rng.choice([step_time, odd_step_time])
        requests, n, tau, _ = random_round(rng, step_time=cost)
        running = {r.request_id: k for r in requests[: rng.randint(0, 3)] for k in [rng.choice([1, 2, 4])]}
        while sum(running.values()) > n:
            running.popitem()
        got = elastic_scale_up(running, requests, cost, tau, n)
        assert got == reference.elastic_scale_up(running, requests, cost, tau, n), case


def test_selective_batching_equals_the_reference():
    rng = random.Random(37)
    for case in range(300):
        requests, n, tau, now = random_round(rng)
        ones = {r.request_id: 1 for r in rng.sample(requests, min(n, len(requests)))}
        args = (ones, requests, step_time, batch_time, tau, now, n, rng.choice([2, 3, 8]), rng.random() < 0.5)
        assert selective_batching(*args) == reference.selective_batching(*args), case


def test_plan_round_decides_as_before_it_read_by_class_on_random_tiered_rounds():
    """Rounds with service tiers (which `round_reference` predates) against `plan_round` as it
    was before it read requests by class, with its tier weights (R + 1)^(tiers below)."""
    from dataclasses import replace

    from tests.sched import round_list

    rng = random.Random(41)
    for case in range(400):
        cost = rng.choice([step_time, odd_step_time])
        requests, n, tau, now = random_round(rng, step_time=cost)
        requests = [replace(r, tier=rng.choice([0, 1, 1, 2])) for r in requests]
        kwargs = {"batch_step_time": rng.choice([None, batch_time]), "max_batch": rng.choice([2, 8]),
                  "run_late": rng.random() < 0.7}
        first = plan_round(requests, cost, n, tau, now, **kwargs)
        assert first == round_list.plan_round(requests, cost, n, tau, now, **kwargs), case
        previous = {rid: a.devices for rid, a in first.allocations.items()}
        assert plan_round(requests, cost, n, tau, now + tau / 2, previous, **kwargs) == round_list.plan_round(
            requests, cost, n, tau, now + tau / 2, previous, **kwargs), case


def test_plan_round_decides_as_before_on_the_benchmark_round_at_ten_thousand():
    """The overhead benchmark's round at 10,000 requests, where the DP saturates early."""
    from gouache.bench.overhead import round_case
    from tests.sched import round_list

    requests, model, tau, now = round_case(10_000)
    expected = round_list.plan_round(requests, model.seconds, 8, tau, now)
    assert plan_round(requests, model.seconds, 8, tau, now) == expected


def test_a_saturated_knapsack_is_left_alone_by_any_later_group():
    """Once `saturated(v, widths, valued)`, adding any group of options of those widths, worth
    at most v and only at the valued widths, changes nothing and picks "none" at every
    reachable capacity; and saturation is found often enough to matter."""
    rng = random.Random(43)
    found = 0
    for _ in range(600):
        knapsack = Knapsack(rng.choice([1, 2, 4, 8]))
        every = [w for w in (1, 2, 4, 8) if w <= knapsack.capacity]
        for _ in range(rng.randint(0, 12)):
            knapsack.add([RoundOption(0, 0, False)] + [RoundOption(rng.choice(every), 1, rng.random() < 0.8)
                                                       for _ in range(rng.randint(1, 3))], rng.choice([1, 3]))
        weight, widths = rng.choice([1, 3]), rng.sample(every, rng.randint(1, len(every)))
        valued = rng.sample(widths, rng.randint(0, len(widths)))
        if not knapsack.saturated(weight, widths, valued):
            continue
        found += 1
        dp = list(knapsack.dp)
        options = [RoundOption(0, 0, False)] + [RoundOption(w, 1, w in valued and rng.random() < 0.8)
                                                for w in rng.choices(widths, k=3)]
        assert not knapsack.add(options, weight) and knapsack.dp == dp
        assert all(pick == (0 if dp[c] >= 0 else -1) for c, pick in enumerate(knapsack.back[-1]))
    assert found > 100


def test_plan_round_decides_as_before_on_large_tiered_rounds_with_crowded_classes():
    """Hundreds of requests in few classes, deadlines crowded near the round's thresholds:
    most of each class is passed over unread while the DP is saturated, and read again from
    the right member when another request changes it."""
    from dataclasses import replace

    from tests.sched import round_list

    rng = random.Random(47)
    for case in range(40):
        cost = rng.choice([step_time, odd_step_time])
        requests, n, tau, now = random_round(rng, size=rng.randint(100, 300), step_time=cost)
        requests = [replace(r, resolution=rng.choice([512, 1024]), remaining_steps=rng.choice([2, 20]),
                            tier=rng.choice([0, 1, 1]),
                            deadline=r.deadline if rng.random() < 0.3 else now + rng.uniform(0.0, 3 * tau + 1.0))
                    for r in requests]
        kwargs = {"batch_step_time": rng.choice([None, batch_time]), "run_late": rng.random() < 0.7}
        assert plan_round(requests, cost, n, tau, now, **kwargs) == round_list.plan_round(
            requests, cost, n, tau, now, **kwargs), case
