import itertools
import math
import random

import pytest

from gouache.sched.batching import selective_batching
from gouache.sched.deadline_plans import deadline_allocations, minimal_feasible_degree, round_options
from gouache.sched.elastic import elastic_scale_up
from gouache.sched.group_knapsack import group_knapsack
from gouache.sched.knapsack import plan_round
from gouache.sched.placement import place
from gouache.sched.rounds import RoundOption, RoundRequest

from .round_cases import TABLE, assert_valid, batch_time, random_groups, req, step_time

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
