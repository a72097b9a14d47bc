import random

import pytest

from gouache.config import SchedulerConfig
from gouache.sched.interface import Devices
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler

from .factories import groups, make_state, run_step


class Linear:
    """step_time = base + per_image * n (+ extra when more than one image): hand-checkable."""

    def __init__(self, base=0.1, per_image=0.05, extra=0.0):
        self.base, self.per_image, self.extra = base, per_image, extra

    def step_time(self, resolutions, patched, degree=1):
        return self.base + self.per_image * len(resolutions) + (self.extra if len(resolutions) > 1 else 0.0)


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
    assert plan.admit == ["urgent"] and groups(plan) == [["urgent"]]


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
    run_step(s)
    s.add(with_deadline("newcomer", deadline=50.0))  # with it, steps take 0.2 s: 2.0 s > 1.6 s
    plan = s.schedule(0.0)
    assert plan.admit == [] and groups(plan) == [["running"]]
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


# -- exactness of the fast path ------------------------------------------------------------------


class ByResolution:
    """A resolution-dependent, non-linear predictor: patched step time grows with the pixels batched."""

    def step_time(self, resolutions, patched, degree=1):
        pixels = sum(h * w for h, w in resolutions) / 64
        return 0.02 + 1e-5 * pixels + 2e-11 * pixels**2


def random_states(rng, n, prefix="w", started=False):
    """Few shapes, step counts and deadlines, so slacks tie often; every 4th-ish without an SLO."""
    states = []
    for i in range(n):
        state = make_state(f"{prefix}{i}", resolution=rng.choice([(256, 256), (512, 512), (512, 768)]),
                           steps=rng.choice([4, 10]), arrival=float(i))
        state.steps_done = rng.randint(0, state.num_steps - 1) if started else 0
        state.deadline = None if rng.random() < 0.25 else rng.choice([2.0, 3.0, 5.0, rng.uniform(0.5, 30)])
        states.append(state)
    return states


def reference_slack(policy, s, now):
    """slack_i as first written: one predictor call per request."""
    if s.deadline is None:
        return float("inf")
    alone = policy.predictor.step_time([s.resolution], patched=True)
    return (s.deadline - now - s.remaining_steps * alone) / (s.num_steps * alone)


def reference_plan(policy, waiting, running, now):
    """The policy as first written: sorted by slack, every step time asked afresh."""
    def alone(s):
        return policy.predictor.step_time([s.resolution], patched=True)

    def step(states):
        return policy.predictor.step_time([s.resolution for s in states], patched=True)

    def misses(s, t):
        return s.deadline is not None and now + s.remaining_steps * t > s.deadline

    batch, admit, drop = list(running), [], []
    for candidate in sorted(waiting, key=lambda s: reference_slack(policy, s, now)):
        if len(batch) >= policy.config.max_batch_size:
            break
        if misses(candidate, alone(candidate)):
            drop.append(candidate.request_id)
            continue
        with_candidate, without = step([*batch, candidate]), step(batch) if batch else 0.0
        if any(misses(s, with_candidate) and not misses(s, without) for s in batch):
            break
        if batch and (step(batch) + step([candidate])) / with_candidate < 1.0:
            break
        batch.append(candidate)
        admit.append(candidate.request_id)
    return [[s.request_id for s in batch]] if batch else [], admit, drop


@pytest.mark.parametrize("predictor", [Linear(), Linear(extra=0.01), ByResolution()],
                         ids=["linear", "extra", "by-resolution"])
def test_order_and_plan_equal_the_plain_sorted_by_slack_policy(predictor):
    rng = random.Random(13)
    for _ in range(200):
        policy = make_policy(SchedulerConfig(policy="patched-slo", max_batch_size=rng.choice([1, 4, 8])), predictor)
        waiting = random_states(rng, rng.randint(0, 40))
        running = random_states(rng, rng.randint(0, 3), prefix="r", started=True)
        now = rng.choice([0.0, 0.5, rng.uniform(0, 3)])
        plain = sorted(waiting, key=lambda s: reference_slack(policy, s, now))
        assert [s.request_id for s in policy.by_slack(waiting, now)] == [s.request_id for s in plain]
        plan = policy.plan(waiting, running, now, Devices(1, (0,)))
        assert (groups(plan), plan.admit, plan.drop) == reference_plan(policy, waiting, running, now)


@pytest.mark.parametrize("predictor", [Linear(), Linear(extra=0.01), ByResolution()],
                         ids=["linear", "extra", "by-resolution"])
def test_the_scheduler_queue_gives_the_order_and_plan_of_a_full_sort(predictor):
    """Given the scheduler's queue (`sched.waiting`, groups merged by their heads), the policy
    reads the candidates in the order, and makes the plan, of sorting every waiting request
    by tier and slack, ties in queue order; also as requests join and leave."""
    from gouache.sched.waiting import WaitingQueue

    rng = random.Random(29)
    for _ in range(200):
        policy = make_policy(SchedulerConfig(policy="patched-slo", max_batch_size=rng.choice([1, 4, 8])), predictor)
        queue = WaitingQueue()
        states = random_states(rng, rng.randint(0, 40))
        for state in states:
            state.tier = rng.choice([0, 1, 1, 2])
            state.fair_tag = rng.choice([0.0, 1.0])
            queue[state.request_id] = state
        for state in rng.sample(states, len(states) // 4):
            del queue[state.request_id]
        running = random_states(rng, rng.randint(0, 3), prefix="r", started=True)
        now = rng.choice([0.0, 0.5, rng.uniform(0, 3)])
        listed = list(queue.ordered)
        assert listed == sorted(queue.values(), key=lambda s: (s.tier, s.fair_tag, s.arrival_time))
        plain = sorted(listed, key=lambda s: (s.tier, reference_slack(policy, s, now)))
        assert [s.request_id for s in policy.by_slack(queue.ordered, now)] == [s.request_id for s in plain]
        plan, reference = (policy.plan(queue.ordered, running, now, Devices(1, (0,))),
                           policy.plan(listed, running, now, Devices(1, (0,))))
        assert (groups(plan), plan.admit, plan.drop, plan.pause) == (groups(reference), reference.admit, reference.drop,
                                                                     reference.pause)
