"""Step-time tables, requests and the plan checks that the round planner's tests share."""

import math

from gouache.sched.rounds import RoundOption, RoundRequest

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


def random_groups(rng, capacity):
    groups = []
    for _ in range(rng.randint(0, 6)):
        group = [RoundOption(0, 0, rng.random() < 0.4)]
        for _ in range(rng.randint(0, 3)):
            width = rng.choice([1, 2, 4, 8, rng.randint(1, capacity + 2)])
            group.append(RoundOption(width, rng.randint(1, 9), rng.random() < 0.6))
        groups.append(group)
    return groups


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
