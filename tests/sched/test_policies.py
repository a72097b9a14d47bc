import pytest

from gouache.config import SchedulerConfig
from gouache.outputs import StepOutput
from gouache.request import RequestStatus
from gouache.sched.interface import Scheduler
from gouache.sched.policies import make_policy

from .factories import make_state, run_step


def scheduler(policy: str, max_batch: int = 8) -> Scheduler:
    return Scheduler(make_policy(SchedulerConfig(policy=policy, max_batch_size=max_batch)))


def test_orca_new_request_joins_at_next_step():
    s = scheduler("orca")
    s.add(make_state("a", steps=3))
    plan, _ = run_step(s)
    assert plan.groups == [["a"]] and plan.admit == ["a"]
    s.add(make_state("b", steps=3))
    plan, _ = run_step(s)
    assert plan.groups == [["a", "b"]] and plan.admit == ["b"]


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
    s.add(make_state("a", shape=(32, 32)))
    s.add(make_state("b", shape=(32, 48)))
    s.add(make_state("c", shape=(32, 32)))
    plan, _ = run_step(s)
    assert plan.groups == [["a", "c"], ["b"]]


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
    assert plan.groups == [["a", "b"]] and finished == ["b"]
    s.add(make_state("c", steps=1))
    plan, finished = run_step(s)
    assert plan.groups == [["a"]] and finished == ["a"]  # "c" waits although a slot is free
    plan, finished = run_step(s)
    assert plan.groups == [["c"]] and finished == ["c"]


def test_fcfs_static_batches_only_the_head_requests_shape():
    s = scheduler("fcfs-static")
    s.add(make_state("a", shape=(32, 32)))
    s.add(make_state("b", shape=(64, 64)))
    s.add(make_state("c", shape=(32, 32)))
    plan, _ = run_step(s)
    assert plan.groups == [["a", "c"]]


def test_abort_removes_waiting_and_running_requests():
    s = scheduler("orca")
    s.add(make_state("a"))
    s.add(make_state("b"))
    plan = s.schedule(0.0)
    s.add(make_state("c"))
    assert s.abort("a").status == RequestStatus.RUNNING
    assert s.abort("c").status == RequestStatus.WAITING
    assert s.abort("zzz") is None
    finished = s.update(plan, StepOutput(plan.request_ids, 0.0))
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
    s.add(make_state("a", shape=(32, 32), steps=1))
    s.add(make_state("b", shape=(32, 48)))
    s.add(make_state("c", shape=(64, 64)))
    s.add(make_state("d", shape=(32, 32)))
    plan, finished = run_step(s)
    assert plan.patched and plan.groups == [["a", "b", "c"]] and finished == ["a"]
    plan, _ = run_step(s)
    assert plan.groups == [["b", "c", "d"]] and plan.admit == ["d"]
