"""`ReplyWatch`: which workers count as hung, on a hand-driven clock (its thread never starts)."""

import time

import pytest

from gouache.executor.base import ReplyWatch


def watch(deadline_s: float = 10.0) -> ReplyWatch:
    return ReplyWatch(2, deadline_s, collective_timeout_s=5.0, on_hung=lambda rank, why: None)


def test_a_worker_silent_past_the_deadline_while_it_owes_a_reply_is_hung_once():
    w, now = watch(), time.monotonic()
    w.sent(1)
    assert w.hung(now + 9) == []
    assert w.hung(now + 11) == [1]
    assert w.hung(now + 20) == []  # reported once: the executor kills it


def test_an_idle_worker_is_never_hung():
    w, now = watch(), time.monotonic()
    w.sent(0)
    w.replied(0)
    assert w.hung(now + 100) == []


def test_silence_runs_from_the_last_reply_so_a_queued_call_is_not_charged_the_wait():
    w = watch()
    w.sent(0)  # a long step...
    w.sent(0)  # ...and a call queued behind it
    time.sleep(0.05)
    w.replied(0)  # the step ends: the worker is alive, the queued call starts now
    answered = time.monotonic()
    assert w.hung(answered + 9) == []
    assert w.hung(answered + 11) == [0]


def test_a_deadline_within_the_collective_timeout_is_refused():
    with pytest.raises(ValueError, match="must exceed the collective timeout"):
        ReplyWatch(2, 5.0, collective_timeout_s=5.0, on_hung=lambda rank, why: None)
