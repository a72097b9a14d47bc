import pytest

from gouache.config import SchedulerConfig
from gouache.sched.interface import Scheduler
from gouache.sched.policies import make_policy

from .factories import make_state


class Linear:
    """step_time = base + per_image * n (+ extra when more than one image): hand-checkable."""

    def __init__(self, base=0.1, per_image=0.05, extra=0.0):
        self.base, self.per_image, self.extra = base, per_image, extra

    def step_time(self, shapes, patched):
        return self.base + self.per_image * len(shapes) + (self.extra if len(shapes) > 1 else 0.0)


def scheduler(predictor=None, max_batch=8):
    config = SchedulerConfig(policy="patched-slo", max_batch_size=max_batch)
    return Scheduler(make_policy(config, predictor or Linear()))


def with_deadline(rid, deadline, steps=10, arrival=0.0):
    state = make_state(rid, steps=steps, arrival=arrival)
    state.deadline = deadline
    return state


def test_least_slack_request_goes_first():
    s = scheduler(max_batch=1)
    s.add(with_deadline("relaxed", deadline=100.0))
    s.add(with_deadline("urgent", deadline=3.0))  # alone: 10 steps x 0.15 s = 1.5 s
    plan = s.schedule(0.0)
    assert plan.admit == ["urgent"] and plan.groups == [["urgent"]]


def test_hopeless_request_is_dropped_and_others_still_run():
    s = scheduler()
    s.add(with_deadline("hopeless", deadline=1.0))  # needs 1.5 s even alone
    s.add(with_deadline("fine", deadline=10.0))
    plan = s.schedule(0.0)
    assert plan.drop == ["hopeless"] and plan.admit == ["fine"]
    assert "hopeless" not in s.waiting and "hopeless" not in s.running


def test_schedulability_test_protects_running_requests():
    s = scheduler()
    s.add(with_deadline("running", deadline=1.6))  # 10 x 0.15 = 1.5 s alone: just fits
    s.schedule(0.0)
    s.add(with_deadline("newcomer", deadline=50.0))  # with it, steps take 0.2 s: 2.0 s > 1.6 s
    plan = s.schedule(0.0)
    assert plan.admit == [] and plan.groups == [["running"]]
    assert list(s.waiting) == ["newcomer"]


def test_benefit_threshold_refuses_batching_that_does_not_pay():
    s = scheduler(Linear(extra=0.2))  # a batch of two costs 0.4 s, two separate forwards 0.3 s
    s.add(make_state("a"))
    s.add(make_state("b"))
    plan = s.schedule(0.0)
    assert plan.admit == ["a"]
    s2 = scheduler(Linear())  # batch of two 0.2 s < 0.3 s separately: admit both
    s2.add(make_state("a"))
    s2.add(make_state("b"))
    assert s2.schedule(0.0).admit == ["a", "b"]


def test_requests_without_slo_are_fcfs_after_those_with_one():
    s = scheduler()
    s.add(make_state("no-slo-1"))
    s.add(make_state("no-slo-2"))
    s.add(with_deadline("slo", deadline=20.0))
    assert s.schedule(0.0).admit == ["slo", "no-slo-1", "no-slo-2"]


def test_needs_a_predictor():
    with pytest.raises(ValueError, match="cost model"):
        make_policy(SchedulerConfig(policy="patched-slo"))
