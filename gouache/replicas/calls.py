"""The front's calls to its replicas: a command sent and its reply awaited, both under one deadline.

A ZeroMQ PUSH socket holds a send for as long as it has no peer to queue it to: forever once
its replica is gone (the bound end never reconnects), and once a hung replica leaves a full
queue (1000 commands) unread. Issue 32 saw /v1/status, and then SIGTERM, hang there: a status
call sent after a replica died but before the watcher noticed never returned. So a send is
never awaited on its own: a call awaits its answer, which the reply, the send's failure, the
replica's loss (`fail`) or the deadline settles, whichever comes first; a send still pending
then is cancelled, so a late command never reaches a replica that was given up on.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from gouache.errors import GouacheError, WorkerFailureError
from gouache.replicas.process import encode


@dataclass(frozen=True)
class Deadlines:
    """How long the front waits for each kind of call to a replica, and how it tells a hung one.

    A replica answers from its own asyncio loop, never from its engine's thread, so a long
    denoising step delays none of these; each bound is what the replica's work for the call
    may take at worst, with room to spare."""

    query_s: float = 10.0  # status, metrics, adapter listings: read from memory (a directory's listing at most)
    submit_s: float = 60.0  # a submit decodes an edit's upload and checks its adapters' headers on the codec
    # processes and threads, behind whatever else is queued there
    register_s: float = 300.0  # registering reads a whole adapter file and loads it on every device (the
    # ControlNet service's own bound on one answer is 240 s, 0.8 of the worker timeout)
    drain_margin_s: float = 10.0  # a drain answers once its grace is over; this much later it is taken for hung
    close_s: float = 10.0  # a close stops the engine's threads and joins its codec processes; also how long
    # a closed replica gets to exit before it is killed
    ping_s: float = 5.0  # how often each live replica is pinged, and how long it has to answer
    missed_pings: int = 3  # a replica that misses this many pings in a row (25-30 s at the defaults) is hung:
    # it is killed and its requests fail; one missed ping (a moment of swapping, a stalled front) is forgiven

    def __post_init__(self):
        for name in ("query_s", "submit_s", "register_s", "drain_margin_s", "close_s", "ping_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Deadlines.{name} must be positive (seconds), got {getattr(self, name)}")
        if self.missed_pings < 1:
            raise ValueError(f"Deadlines.missed_pings must be at least 1, got {self.missed_pings}")


class ReplicaLostError(WorkerFailureError):
    """A call's replica did not answer: it was lost (exited, or killed as hung) or its deadline
    passed. What the call asked for may or may not have been done there."""


@dataclass
class _Pending:
    replica: int  # the replica's index
    kind: str  # the command, for the error naming it
    answer: asyncio.Future  # settled by the reply, a failed send or the replica's loss


class Calls:
    """The calls in flight to every replica, by call id."""

    def __init__(self):
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()

    async def call(self, replica: int, commands: zmq.asyncio.Socket, kind: str, *args: Any, timeout_s: float) -> Any:
        """Send `(kind, call id, *args)` to replica `replica` and return its reply within
        `timeout_s`; raise the GouacheError it answered with, or ReplicaLostError."""
        call = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        sending = commands.send(encode((kind, call, *args)))  # queued now, or once the socket can take it
        sending.add_done_callback(lambda sent: _fail_if_unsent(sent, answer, replica, kind))
        self._pending[call] = _Pending(replica, kind, answer)  # in time: the reply is read only after we yield
        try:
            value = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError:
            raise ReplicaLostError(f"replica {replica} did not answer {kind!r} within {timeout_s:g} s") from None
        finally:
            sending.cancel()  # a no-op once sent
            del self._pending[call]
        if isinstance(value, GouacheError):
            raise value
        return value

    def answer(self, call: int, value: Any) -> None:
        """A reply arrived (a call that gave up already is not waiting for it)."""
        pending = self._pending.get(call)
        if pending is not None and not pending.answer.done():
            pending.answer.set_result(value)

    def fail(self, replica: int, reason: str) -> None:
        """Replica `replica` is lost for `reason` ("exited (status -9)"): its calls fail now."""
        for pending in self._pending.values():
            if pending.replica == replica and not pending.answer.done():
                pending.answer.set_exception(ReplicaLostError(f"replica {replica} {reason} before answering "
                                                              f"{pending.kind!r}"))


def tell(commands: zmq.asyncio.Socket, message: tuple) -> None:
    """Send a command that has no reply (an abort) if it can be queued now, else drop it: its
    replica is then gone or hung, and its loss fails what the command was about anyway."""
    commands.send(encode(message), zmq.NOBLOCK).add_done_callback(_consume)


def _fail_if_unsent(sent: asyncio.Future, answer: asyncio.Future, replica: int, kind: str) -> None:
    if not sent.cancelled() and sent.exception() is not None and not answer.done():
        answer.set_exception(ReplicaLostError(f"replica {replica}: {kind!r} could not be sent ({sent.exception()})"))


def _consume(sent: asyncio.Future) -> None:
    """Read a dropped command's failure, which asyncio would otherwise log as never retrieved."""
    if not sent.cancelled():
        sent.exception()
