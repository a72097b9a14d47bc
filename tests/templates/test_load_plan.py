import itertools
import random

import pytest

from gouache.templates.load_plan import plan_loads


def simulate(use, masked, full, load):
    """Finish time of a given choice: loads in order on their own stream, compute waits for them."""
    comp = loaded = 0.0
    for u, c_m, c_f, c_l in zip(use, masked, full, load):
        if u:
            loaded += c_l
            comp = max(comp, loaded) + c_m
        else:
            comp += c_f
    return comp


def test_fast_loads_are_hidden_behind_compute():
    plan = plan_loads(masked_s=[1, 1, 1], full_s=[5, 5, 5], load_s=[0.5, 0.5, 0.5])
    assert plan.use_cache == (True, True, True) and plan.latency_s == pytest.approx(3.5)


def test_slow_loads_fall_back_to_full_compute():
    plan = plan_loads(masked_s=[1, 1], full_s=[2, 2], load_s=[10, 10])
    assert plan.use_cache == (False, False) and plan.latency_s == 4


def test_mixed_case_loads_only_where_it_pays():
    # block 0 would stall 3 s waiting for its load; later blocks' loads overlap block 0's compute
    plan = plan_loads(masked_s=[1, 1, 1], full_s=[2, 2, 2], load_s=[3, 1, 1])
    assert plan.use_cache == (False, True, True)
    assert plan.latency_s == simulate(plan.use_cache, [1, 1, 1], [2, 2, 2], [3, 1, 1]) == 4


def test_plan_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        masked = [rng.uniform(0.1, 1) for _ in range(n)]
        full = [m + rng.uniform(0, 2) for m in masked]
        load = [rng.uniform(0, 3) for _ in range(n)]
        plan = plan_loads(masked, full, load)
        assert plan.latency_s == pytest.approx(simulate(plan.use_cache, masked, full, load))
        best = min(simulate(u, masked, full, load) for u in itertools.product([False, True], repeat=n))
        assert plan.latency_s == pytest.approx(best)


def test_lengths_must_match():
    with pytest.raises(ValueError, match="one entry per block"):
        plan_loads([1], [1, 2], [1])


def test_a_load_that_pays_locally_can_cost_later_blocks():
    # greedy loads block 0 (a tie: 2 = 2), which delays block 1's load to t=4; skipping it lets
    # block 1's load overlap block 0's compute and finish at t=2
    plan = plan_loads(masked_s=[0, 0], full_s=[2, 10], load_s=[2, 2])
    assert plan.use_cache == (False, True) and plan.latency_s == pytest.approx(2.0)


def test_frontier_stays_small_for_a_flux_sized_model_with_uniform_blocks():
    n = 57  # FLUX.1-dev: 19 double + 38 single blocks, each kind with its own costs
    masked = [0.4] * 19 + [0.2] * 38
    plan = plan_loads(masked, [m * 5 for m in masked], [0.3] * 19 + [0.15] * 38)
    assert len(plan.use_cache) == n and plan.latency_s < sum(m * 5 for m in masked)
