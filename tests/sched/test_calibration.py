import math

import pytest

from gouache.config import SchedulerConfig
from gouache.sched.calibration import BOUNDS, Calibrated
from gouache.sched.interface import Devices
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler

from .factories import make_state


class PerImage:
    """0.1 s per image; a size other than 64 px is one it never saw; degree 2 it cannot price."""

    def step_time(self, resolutions, patched, degree=1):
        if any(r != (64, 64) for r in resolutions):
            raise ValueError("not profiled")
        return 0.1 * len(resolutions) if degree == 1 else math.inf

    def sizes(self, patched):
        return {(64, 64)}


def test_it_predicts_as_its_cost_model_until_it_has_measured():
    c = Calibrated(PerImage())
    assert c.step_time([(64, 64)] * 3, patched=True) == pytest.approx(0.3)
    assert c.sizes(True) == {(64, 64)} and c.observed == 0


def test_each_step_moves_the_scale_a_weight_of_the_way_to_its_ratio():
    c = Calibrated(PerImage(), weight=0.5)
    c.observe([(64, 64), (64, 64)], True, 1, 0.4)  # 0.4 s against 0.2 predicted: ratio 2
    assert c.scale == pytest.approx(1.5)
    c.observe([(64, 64)], True, 1, 0.2)
    assert c.scale == pytest.approx(1.75)
    assert c.step_time([(64, 64)], patched=False) == pytest.approx(0.175)


def test_a_steady_ratio_is_where_the_scale_settles():
    c = Calibrated(PerImage())
    for _ in range(300):
        c.observe([(64, 64)], True, 1, 0.129)
    assert c.scale == pytest.approx(1.29, rel=1e-4) and c.observed == 300


def test_an_outlier_moves_it_no_further_than_the_bound_and_unpriced_steps_not_at_all():
    c = Calibrated(PerImage(), weight=0.5)
    c.observe([(64, 64)], True, 1, 100.0)  # a stall of 1000x
    assert c.scale == pytest.approx(0.5 + 0.5 * BOUNDS[1])
    before = c.scale
    c.observe([(96, 96)], True, 1, 1.0)  # a size the cost model never saw
    c.observe([(64, 64)], True, 2, 1.0)  # a degree it cannot price
    c.observe([(64, 64)], True, 1, 0.0)
    assert c.scale == before and c.observed == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="weight"):
        Calibrated(PerImage(), weight=0.0)
    with pytest.raises(ValueError, match="scale"):
        Calibrated(PerImage(), scale=-1.0)


def test_a_deadline_policy_plans_with_the_measured_scale():
    """A deadline met at the profiled step time is unattainable once steps are seen to take 2x."""
    calibrated = Calibrated(PerImage(), weight=1.0)
    scheduler = Scheduler(make_policy(SchedulerConfig(policy="patched-slo", max_batch_size=4), calibrated))
    state = make_state("r", resolution=(64, 64), steps=10)
    state.deadline = 1.5  # 10 steps x 0.1 s fits
    scheduler.add(state)
    calibrated.observe([(64, 64)], True, 1, 0.2)
    assert scheduler.schedule(0.0).drop == ["r"]
    uncalibrated = Scheduler(make_policy(SchedulerConfig(policy="patched-slo", max_batch_size=4), PerImage()))
    same = make_state("r", resolution=(64, 64), steps=10)
    same.deadline = 1.5
    uncalibrated.add(same)
    assert uncalibrated.schedule(0.0).admit == ["r"]


def test_the_round_policy_prices_its_rounds_at_the_current_scale():
    """round-knapsack memoises step times across rounds: once the scale moves, its tables follow."""
    calibrated = Calibrated(PerImage(), weight=1.0)
    policy = make_policy(SchedulerConfig(policy="round-knapsack", round_s=0.05), calibrated)
    assert policy.step_time((64, 64), 1) == pytest.approx(0.1)
    calibrated.observe([(64, 64)], False, 1, 0.3)
    policy.plan([make_state("r", resolution=(64, 64), steps=10)], [], 0.0, Devices(1, (0,)))
    assert policy.step_time((64, 64), 1) == pytest.approx(0.3)
