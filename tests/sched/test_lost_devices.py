"""Whether each policy can still plan once some devices are lost for good (their workers died):
the engine stops, instead of letting requests wait forever, when the answer is no."""

import pytest

from gouache.config import SchedulerConfig
from gouache.sched.interface import Devices
from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler

from .factories import make_state

BOTH_DEGREES = ParallelCostModel({(64, 64): {1: 0.1, 2: 0.06, 4: 0.04}})
ONLY_DEGREE_2 = ParallelCostModel({(64, 64): {2: 0.06}})  # no time for one device: it never plans degree 1


def policy(name: str, cost=BOTH_DEGREES):
    return make_policy(SchedulerConfig(policy=name), cost)


@pytest.mark.parametrize("name", ["fcfs-static", "orca", "patched", "patched-slo"])
def test_a_step_policy_needs_its_one_device(name):
    p = policy(name)
    assert p.can_plan_on(Devices(1, (0,)))
    assert not p.can_plan_on(Devices(1, ()))
    assert "device 0" in p.needs(1)


@pytest.mark.parametrize("count, live, ok", [
    (2, (0, 1), True),
    (2, (0,), False),
    (2, (1,), False),
    (2, (), False),
    (4, (2, 3), True),
    (4, (0, 1, 3), True),
    (4, (0, 2), False),
    (4, (1, 2), False),  # two live devices, but not an aligned block
])
def test_fixed_sp_2_needs_an_aligned_block_of_2_live_devices(count, live, ok):
    assert policy("fixed-sp-2").can_plan_on(Devices(count, live)) is ok


def test_fixed_sp_k_names_the_blocks_it_needs():
    assert policy("fixed-sp-2").needs(4) == "an aligned block of 2 live devices (0-1 or 2-3)"
    assert policy("fixed-sp-4").needs(4) == "an aligned block of 4 live devices (0-3)"
    assert not policy("fixed-sp-4").can_plan_on(Devices(4, (0, 1, 2)))
    assert policy("fixed-sp-1").can_plan_on(Devices(4, (3,)))


@pytest.mark.parametrize("count, live, ok", [(2, (0, 1), True), (2, (1,), True), (4, (2,), True), (2, (), False)])
def test_round_knapsack_serves_on_any_live_device(count, live, ok):
    assert policy("round-knapsack").can_plan_on(Devices(count, live)) is ok


@pytest.mark.parametrize("count, live, ok", [(2, (0, 1), True), (2, (0,), False), (4, (2, 3), True),
                                             (4, (0, 2, 3), True), (4, (0, 2), False)])
def test_round_knapsack_whose_cost_model_prices_no_single_device_needs_a_pair(count, live, ok):
    p = policy("round-knapsack", ONLY_DEGREE_2)
    assert p.can_plan_on(Devices(count, live)) is ok
    assert p.needs(count) == "an aligned block of 2 live devices"


def test_the_scheduler_offers_the_policy_every_device_not_lost():
    s = Scheduler(policy("fixed-sp-2"), 4)
    s.add(make_state("a"))
    s.schedule(0.0)  # "a" runs on 0-1: busy devices are still live
    assert s.live() == Devices(4, (0, 1, 2, 3)) and s.can_serve()
    s.lose({1})
    assert s.live() == Devices(4, (0, 2, 3)) and s.can_serve()
    s.lose({3})
    assert s.live() == Devices(4, (0, 2)) and not s.can_serve()
