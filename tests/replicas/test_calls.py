"""`Calls` on bare ZeroMQ sockets, no replica process: a reply, a deadline, a lost replica."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from gouache.errors import QueueFullError
from gouache.replicas.calls import Calls, Deadlines, ReplicaLostError, tell
from gouache.replicas.process import decode


def run_with_commands(tmp_path, scenario, connected: bool):
    """Run `scenario(calls, commands, replica)` with a bound PUSH socket of commands, and the
    replica's PULL end connected to it or (None) none at all."""

    async def main():
        context = zmq.asyncio.Context()
        commands = context.socket(zmq.PUSH)
        commands.bind(f"ipc://{tmp_path}/commands")
        replica = None
        if connected:
            replica = context.socket(zmq.PULL)
            replica.connect(f"ipc://{tmp_path}/commands")
        try:
            return await scenario(Calls(), commands, replica)
        finally:
            context.destroy(linger=0)

    return asyncio.run(main())


def test_a_call_returns_the_reply_or_raises_the_error_answered(tmp_path):
    async def scenario(calls, commands, replica):
        answers = []
        for value in ("ok", QueueFullError("full")):
            call = asyncio.ensure_future(calls.call(0, commands, "submit", "img_1", [], timeout_s=5))
            kind, call_id, *args = decode(await replica.recv())
            calls.answer(call_id, value)
            answers.append((kind, args, await asyncio.gather(call, return_exceptions=True)))
        return answers

    (kind, args, ok), (_, _, full) = run_with_commands(tmp_path, scenario, connected=True)
    assert (kind, args, ok) == ("submit", ["img_1", []], ["ok"])
    assert isinstance(full[0], QueueFullError)


def test_a_send_nobody_takes_ends_at_the_deadline_or_at_the_replicas_loss(tmp_path):
    """A PUSH socket with no peer holds a send forever: the call still ends, naming the replica and the call."""

    async def scenario(calls, commands, replica):
        with pytest.raises(ReplicaLostError, match=r"replica 3 did not answer 'status' within 0.2 s"):
            await calls.call(3, commands, "status", timeout_s=0.2)
        drain = asyncio.ensure_future(calls.call(3, commands, "drain", 1.0, timeout_s=60))
        await asyncio.sleep(0.05)
        calls.fail(3, "exited (status -9)")
        with pytest.raises(ReplicaLostError, match=r"replica 3 exited \(status -9\) before answering 'drain'"):
            await asyncio.wait_for(drain, 1)
        tell(commands, ("abort", "img_1"))  # dropped at once: neither waits nor raises
        return calls._pending

    assert run_with_commands(tmp_path, scenario, connected=False) == {}


def test_deadlines_refuse_what_would_disable_them():
    with pytest.raises(ValueError, match="ping_s must be positive"):
        Deadlines(ping_s=0)
    with pytest.raises(ValueError, match="missed_pings must be at least 1"):
        Deadlines(missed_pings=0)
