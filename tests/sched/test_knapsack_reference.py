"""The round planner's fast paths decide exactly as the plain algorithm (`round_reference`)."""

import random

from gouache.sched.batching import selective_batching
from gouache.sched.deadline_plans import deadline_allocations
from gouache.sched.elastic import elastic_scale_up
from gouache.sched.group_knapsack import Knapsack
from gouache.sched.knapsack import plan_round
from gouache.sched.rounds import RoundOption

from . import round_reference as reference
from .round_cases import batch_time, odd_step_time, random_round, step_time

# -- the fast paths decide exactly as the plain algorithm ---------------------------------------
# `round_reference` is plan_round as first written: options for every request, a heap of every
# request in scale-up, lateness tested per request. The fast one must match it on every case.


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
