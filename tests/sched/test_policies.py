import pytest

from gouache.config import SchedulerConfig
from gouache.request import RequestStatus
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler

from .factories import groups, make_state, run_step


def scheduler(policy: str, max_batch: int = 8) -> Scheduler:
    return Scheduler(make_policy(SchedulerConfig(policy=policy, max_batch_size=max_batch)))


def test_orca_new_request_joins_at_next_step():
    s = scheduler("orca")
    s.add(make_state("a", steps=3))
    plan, _ = run_step(s)
    assert groups(plan) == [["a"]] and plan.admit == ["a"]
    s.add(make_state("b", steps=3))
    plan, _ = run_step(s)
    assert groups(plan) == [["a", "b"]] and plan.admit == ["b"]


def test_orca_finished_request_leaves_at_once_and_frees_its_slot():
    s = scheduler("orca", max_batch=2)
    s.add(make_state("short", steps=1))
    s.add(make_state("long", steps=3))
    s.add(make_state("late", steps=1))
    plan, finished = run_step(s)
    assert plan.request_ids == ["short", "long"] and finished == ["short"]
    plan, finished = run_step(s)
    assert plan.request_ids == ["long", "late"] and finished == ["late"]


def test_orca_groups_one_forward_per_shape():
    s = scheduler("orca")
    s.add(make_state("a", resolution=(256, 256)))
    s.add(make_state("b", resolution=(256, 384)))
    s.add(make_state("c", resolution=(256, 256)))
    plan, _ = run_step(s)
    assert groups(plan) == [["a", "c"], ["b"]]


def test_orca_respects_max_batch_size():
    s = scheduler("orca", max_batch=2)
    for rid in "abc":
        s.add(make_state(rid))
    plan, _ = run_step(s)
    assert plan.request_ids == ["a", "b"] and list(s.waiting) == ["c"]


def test_fcfs_static_batch_runs_to_completion_without_joins():
    s = scheduler("fcfs-static")
    s.add(make_state("a", steps=2))
    s.add(make_state("b", steps=1))
    plan, finished = run_step(s)
    assert groups(plan) == [["a", "b"]] and finished == ["b"]
    s.add(make_state("c", steps=1))
    plan, finished = run_step(s)
    assert groups(plan) == [["a"]] and finished == ["a"]  # "c" waits although a slot is free
    plan, finished = run_step(s)
    assert groups(plan) == [["c"]] and finished == ["c"]


def test_fcfs_static_batches_only_the_head_requests_shape():
    s = scheduler("fcfs-static")
    s.add(make_state("a", resolution=(256, 256)))
    s.add(make_state("b", resolution=(512, 512)))
    s.add(make_state("c", resolution=(256, 256)))
    plan, _ = run_step(s)
    assert groups(plan) == [["a", "c"]]


def test_abort_removes_waiting_and_running_requests():
    s = scheduler("orca")
    s.add(make_state("a"))
    s.add(make_state("b"))
    plan = s.schedule(0.0)
    s.add(make_state("c"))
    assert s.abort("a").status == RequestStatus.RUNNING
    assert s.abort("c").status == RequestStatus.WAITING
    assert s.abort("zzz") is None
    run = s.ready()[0]
    assert s.members(run, 0.0) == ["b"]  # the run goes on without the aborted request
    finished = s.advance(run, plan.request_ids, 0.0).finished
    assert finished == [] and list(s.running) == ["b"] and s.running["b"].steps_done == 1


def test_first_step_time_marks_end_of_queueing():
    s = scheduler("orca")
    s.add(make_state("a"))
    run_step(s, now=5.0)
    run_step(s, now=6.0)
    assert s.running["a"].first_step_time == 5.0


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="orca"):
        make_policy(SchedulerConfig(policy="nope"))


def test_patched_runs_every_size_in_one_forward_and_admits_fcfs():
    s = scheduler("patched", max_batch=3)
    s.add(make_state("a", resolution=(256, 256), steps=1))
    s.add(make_state("b", resolution=(256, 384)))
    s.add(make_state("c", resolution=(512, 512)))
    s.add(make_state("d", resolution=(256, 256)))
    plan, finished = run_step(s)
    assert plan.batches[0].patched and groups(plan) == [["a", "b", "c"]] and finished == ["a"]
    plan, _ = run_step(s)
    assert groups(plan) == [["b", "c", "d"]] and plan.admit == ["d"]
