"""`class_knapsack` reads few of a round's urgent requests; it must run exactly what the DP over
all of them runs."""

import random
from dataclasses import replace

from gouache.sched.class_knapsack import class_knapsack
from gouache.sched.deadline_plans import deadline_allocations, fastest_degree, round_options
from gouache.sched.group_knapsack import Knapsack, group_knapsack
from gouache.sched.round_classes import of_requests
from gouache.sched.rounds import Allocation, RoundOption, cached, max_degree

from .round_cases import odd_step_time, random_groups, random_round, step_time


def urgent_splits(classes, cost, n, tau, now):
    """Each class with the members whose "none" does not survive the round: [0, wait)."""
    top = max_degree(n)
    return [(c, 0, c.bisect(now + tau + c.steps * cost.fastest(c.resolution, top))) for c in classes]


def every_urgent_request(splits, cost, n, tau, now):
    """Algorithm 1 as written: every urgent request in (tier, deadline) order, each with all its
    round options, the ones some option saves into one DP, tiers weighted (N + 1)^(tiers below)."""
    top, lowest = max_degree(n), max((c.tier for c, _, _ in splits), default=0)
    members = sorted((c.order(i), c, i) for c, _, wait in splits for i in range(wait))
    ids, groups, weights = [], [], []
    for _, c, i in members:
        request = c.request(i)
        plan = deadline_allocations(request, cost, now, top) or [
            Allocation(request.remaining_steps, fastest_degree(request, cost, top))]
        options = round_options(request, plan, cost, now, tau, n)
        if any(o.survives for o in options):
            ids.append(request.request_id)
            groups.append(options)
            weights.append((n + 1) ** (lowest - c.tier))
    return {rid: g[j].degree for rid, g, j in zip(ids, groups, group_knapsack(groups, n, weights)) if g[j].degree}


def test_class_knapsack_runs_what_the_dp_over_every_urgent_request_runs():
    """Random rounds, tiers, and crowded classes with deadlines near the round's thresholds."""
    rng = random.Random(53)
    for case in range(500):
        cost = cached(rng.choice([step_time, odd_step_time]))
        requests, n, tau, now = random_round(rng, size=rng.choice([None, rng.randint(60, 250)]), step_time=cost)
        crowded = rng.random() < 0.5
        requests = [replace(r, tier=rng.choice([0, 1, 1, 2]),
                            resolution=rng.choice([512, 1024]) if crowded else r.resolution,
                            remaining_steps=rng.choice([2, 20]) if crowded else r.remaining_steps,
                            deadline=now + rng.uniform(0.0, 3 * tau + 1.0) if crowded and rng.random() < 0.7
                            else r.deadline)
                    for r in requests]
        splits = urgent_splits(of_requests(requests), cost, n, tau, now)
        known = {}
        runners = class_knapsack(splits, cost, n, tau, now, known)
        assert runners == every_urgent_request(splits, cost, n, tau, now), case
        assert set(known) == set(runners)


def test_improves_says_whether_an_option_would_change_the_dp():
    rng = random.Random(59)
    for _ in range(500):
        capacity = rng.choice([1, 2, 4, 8])
        knapsack = Knapsack(capacity)
        for group in random_groups(rng, capacity):
            knapsack.add([RoundOption(0, 0, False), *group[1:]], rng.choice([1, 3]))
        width, value = rng.randint(1, capacity), rng.choice([1, 3])
        trial = Knapsack(capacity)
        trial.dp = list(knapsack.dp)
        assert knapsack.improves(width, value) == trial.add([RoundOption(0, 0, False), RoundOption(width, 1, True)],
                                                             value)


def test_leaving_out_what_cannot_be_chosen_keeps_every_choice():
    """Options that do not survive and take devices, and groups none of whose options improve
    the DP where they come, are left out: the DP still picks the same option in every group
    (and "none" in those left out)."""
    rng = random.Random(61)
    for _ in range(1000):
        capacity = rng.randint(1, 8)
        groups = [[RoundOption(0, 0, False), *group[1:]] for group in random_groups(rng, capacity)]
        weights = [rng.choice([1, 1, 4]) for _ in groups]
        full = group_knapsack(groups, capacity, weights)
        knapsack, kept = Knapsack(capacity), []
        for i, (group, weight) in enumerate(zip(groups, weights)):
            surviving = [o for o in group[1:] if o.survives]
            if any(knapsack.improves(o.width, weight) for o in surviving):
                knapsack.add([group[0], *surviving], weight)
                kept.append(i)
        chosen = dict(zip(kept, (g[j] for g, j in zip(knapsack.groups, knapsack.choice()))))
        for i, (group, j) in enumerate(zip(groups, full)):
            assert chosen.get(i, group[0]) is group[j]
