"""`round-knapsack` on one device through the `Scheduler`: rounds of τ run step by step, as the engine does."""

import math

import pytest

from gouache.config import SchedulerConfig
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler
from gouache.sim.costs import LinearStepCost
from gouache.sim.simulator import simulate
from gouache.sim.workloads import SimRequest

from .factories import groups, make_state, run_step


class PerResolution:
    """A plain forward of b images of one resolution takes 0.05 + 0.1 b s (one image: 0.15 s)."""

    def step_time(self, resolutions, patched, degree=1):
        assert not patched and degree == 1  # one device; the policy batches one resolution at a time
        return sum(0.05 + 0.1 * resolutions.count(res) for res in set(resolutions))


def scheduler(round_s=0.5, max_batch=8):
    return Scheduler(make_policy(SchedulerConfig(policy="round-knapsack", max_batch_size=max_batch, round_s=round_s),
                                 PerResolution()))


def state(rid, resolution=(256, 256), steps=10, arrival=0.0, deadline=None):
    s = make_state(rid, resolution=resolution, steps=steps, arrival=arrival)
    s.deadline = deadline
    return s


def drive(s: Scheduler, arrivals: dict[float, list], until: float = 100.0):
    """Run the scheduler on a clock that advances by each step's predicted time; returns the
    (start time, group) of every step and each request's finish time."""
    now, steps, finished = 0.0, [], {}
    pending = sorted(arrivals.items())
    predictor = PerResolution()
    while (pending or s.has_work()) and now < until:
        while pending and pending[0][0] <= now + 1e-12:
            for st in pending.pop(0)[1]:
                s.add(st)
        if not s.ready():
            s.schedule(now)
        if not s.ready():
            assert not s.has_work(), "work is left but nothing was planned"
            now = pending[0][0]
            continue
        run = s.ready()[0]
        members = s.members(run, now)
        steps.append((round(now, 6), members))
        now += predictor.step_time([s.running[rid].resolution for rid in members], patched=False)
        done = s.advance(run, members, now).finished
        finished.update((st.request_id, round(now, 6)) for st in done)
    return steps, finished


def test_an_urgent_request_preempts_at_the_round_boundary():
    # "loose" (no SLO) runs floor(0.5 / 0.15) = 3 steps, then "urgent" (deadline 1.35 s, 5 steps of
    # 0.15 s) takes the device for the next two rounds and meets it; "loose" resumes after.
    s = scheduler()
    steps, finished = drive(s, {0.0: [state("loose", steps=8)], 0.1: [state("urgent", resolution=(128, 128), steps=5,
                                                                                   arrival=0.1, deadline=1.35)]})
    assert [g for _, g in steps[:3]] == [["loose"]] * 3  # the round is held: urgent waits for its end
    assert [g for _, g in steps[3:8]] == [["urgent"]] * 5
    assert finished["urgent"] == pytest.approx(1.2) and finished["urgent"] <= 1.35
    assert all(g == ["loose"] for _, g in steps[8:]) and len(steps) == 13


def test_orca_would_have_made_the_urgent_request_late():
    # the baseline of the test above: orca batches urgent with loose at 0.15 s, each step then takes 0.3 s
    s = Scheduler(make_policy(SchedulerConfig(policy="orca")))
    s.add(state("loose", steps=8))
    run_step(s, 0.0)
    s.add(state("urgent", resolution=(128, 128), steps=5, arrival=0.1, deadline=1.35))
    plan, _ = run_step(s, 0.15)
    assert groups(plan) == [["loose"], ["urgent"]]  # two plain forwards in one step: 0.3 s, so 0.15 + 5 x 0.3 > 1.35


def test_same_shape_requests_batch_when_no_slo_suffers():
    s = scheduler()
    s.add(state("a"))
    s.add(state("b"))
    plan = s.schedule(0.0)
    assert groups(plan) == [["a", "b"]] and plan.admit == ["a", "b"]


def test_a_round_shorter_than_a_step_still_runs_one_step():
    s = scheduler(round_s=0.01)
    steps, finished = drive(s, {0.0: [state("a", steps=3)]})
    assert [g for _, g in steps] == [["a"]] * 3 and finished["a"] == pytest.approx(0.45)


def test_an_aborted_request_leaves_its_round():
    s = scheduler()
    s.add(state("a"))
    s.add(state("b"))
    plan = s.schedule(0.0)
    assert groups(plan) == [["a", "b"]]
    run = s.ready()[0]
    s.advance(run, s.members(run, 0.0), 0.25)
    s.abort("b")
    assert s.members(run, 0.25) == ["a"]


def test_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost model"):
        make_policy(SchedulerConfig(policy="round-knapsack"))


@pytest.mark.parametrize("round_s", [0.0, -0.0, -5e-324, math.nan, math.inf, 1e308, 3600.001])
def test_round_length_must_be_positive_and_at_most_an_hour(round_s):
    """An infinite round would floor τ / T to an OverflowError; an hour is past any step."""
    with pytest.raises(ValueError, match=r"round_s must be in \(0, 3600\] seconds"):
        SchedulerConfig(policy="round-knapsack", round_s=round_s)
    assert SchedulerConfig(policy="round-knapsack", round_s=5e-324).round_s == 5e-324  # raised to a step's time


def test_runs_in_the_step_simulator_and_finishes_everything():
    cost = LinearStepCost(per_forward_s=0.05, per_megapixel_s=0.4)
    trace = [SimRequest(f"r{i}", arrival=0.3 * i, width=size, height=size, steps=10, slo_s=8.0)
             for i, size in enumerate([256, 512, 256, 512, 256, 256, 512, 256])]
    policy = make_policy(SchedulerConfig(policy="round-knapsack", round_s=0.5), cost)
    result = simulate(trace, policy, cost)
    assert all(r.finish is not None for r in result.records) and len(result.records) == len(trace)


def test_the_policy_reading_the_queue_by_class_plans_as_over_the_whole_list():
    """The policy reads the scheduler's queue by class (`sched.waiting`), converting only the
    requests it reads; a plain list is planned by `plan_round` over everyone. Random queues,
    tiers, running requests with devices, ties of deadline: the same plan."""
    import random

    from gouache.sched.interface import Devices
    from gouache.sched.waiting import WaitingQueue

    rng = random.Random(5)
    table = {(256, 256): {1: 0.05, 2: 0.04, 4: 0.035, 8: 0.035}, (512, 512): {1: 0.10, 2: 0.065, 4: 0.05, 8: 0.045},
             (1024, 1024): {1: 0.40, 2: 0.22, 4: 0.13, 8: 0.08}}

    class Table:
        def step_time(self, resolutions, patched, degree=1):
            return table[resolutions[0]][degree] * (1 + 0.8 * (len(resolutions) - 1))

        def sizes(self, patched):
            return set(table)

    for case in range(150):
        n = rng.choice([1, 2, 4, 8])
        config = SchedulerConfig(policy="round-knapsack", round_s=rng.choice([0.2, 0.5]),
                                 max_batch_size=rng.choice([2, 8]), run_late=rng.random() < 0.7)
        by_class, by_list = make_policy(config, Table()), make_policy(config, Table())
        now, deadlines = rng.uniform(0, 50), []
        queue, running = WaitingQueue(), []
        for i in range(rng.randint(1, 80)):
            state = make_state(f"r{i}", rng.choice(list(table)), steps=rng.choice([5, 20, 30]),
                               arrival=now - rng.random())
            state.tier = rng.choice([0, 1, 1, 2])
            state.deadline = rng.choice([None, now + rng.uniform(0.1, 12), *deadlines[-1:]])
            deadlines.append(state.deadline)
            if rng.random() < 0.15 and len(running) < n:
                state.steps_done = rng.randint(1, state.num_steps - 1)
                state.devices = (len(running),)
                running.append(state)
            else:
                queue[state.request_id] = state
        devices = Devices(n, tuple(range(n)))
        assert by_class.plan(queue.ordered, running, now, devices) == by_list.plan(list(queue.ordered), running, now,
                                                                                   devices), case
