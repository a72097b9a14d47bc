"""`multiproc`: one worker process per device, started and supervised by the engine.

Each worker joins one torch.distributed world (gloo on the CPU, NCCL on GPUs) and makes the
process groups of every aligned device block up front, in the same order on every rank, so a
batch can run on any block at any degree without making a group while serving. Calls go over
one pipe per worker (tensors through shared memory, torch's multiprocessing pickler); one
thread per worker reads its replies, and a closed pipe means the worker died: every call
pending on it fails with `WorkerDied` at once and the rank stays dead. A worker that owes a reply
and sends none for `reply_deadline_s` is taken for hung: it is killed and treated the same way.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from gouache.children import become_child, processes
from gouache.config import WORKER_TIMEOUT_S
from gouache.executor.base import Executor, Gather, ReplyWatch, WorkerDied, free_port, open_gather
from gouache.executor.worker import WorkerSpec, join_world

log = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    kind = "multiproc"

    def __init__(self, spec: WorkerSpec, num_devices: int, start_timeout_s: float = 600.0,
                 collective_timeout_s: float = 60.0, reply_deadline_s: float = WORKER_TIMEOUT_S):
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.num_devices = num_devices
        self._watch = ReplyWatch(num_devices, reply_deadline_s, collective_timeout_s, self._hung)
        context = processes()
        port = free_port()
        self._procs, self._conns, self._send_locks = [], [], []
        for rank in range(num_devices):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, name=f"gouache-worker-{rank}", daemon=True,
                                      args=(rank, num_devices, port, spec, collective_timeout_s, child))
            process.start()
            child.close()
            self._procs.append(process)
            self._conns.append(parent)
            self._send_locks.append(threading.Lock())
        self._calls: dict[int, Gather] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: dict[int, str] = {}
        self._closing = False
        self._readers = [threading.Thread(target=self._read, args=(rank,), name=f"gouache-worker-{rank}-reader",
                                          daemon=True) for rank in range(num_devices)]
        for reader in self._readers:
            reader.start()
        try:
            self.collective_rpc("ping", timeout=start_timeout_s)  # every worker loaded and in the world
        except BaseException:
            self.shutdown()
            raise
        self._watch.start()

    def submit(self, method: str, args: tuple = (), ranks: Sequence[int] | None = None) -> Future[list[Any]]:
        call_id = next(self._ids)
        call = open_gather(ranks, self.num_devices, self._lock, self._dead,
                           lambda gather: self._calls.update({call_id: gather}))
        call.future.add_done_callback(lambda _: self._forget(call_id))
        if call.future.done():  # a rank is dead
            return call.future
        for rank in call.ranks:
            self._watch.sent(rank)
            try:
                with self._send_locks[rank]:
                    self._conns[rank].send((call_id, method, args))
            except (OSError, EOFError) as error:
                self._died(rank, f"its pipe is closed ({error})")
        return call.future

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def shutdown(self) -> None:
        self._closing = True
        self._watch.stop()
        for rank, conn in enumerate(self._conns):
            try:
                with self._send_locks[rank]:
                    conn.send(None)
            except (OSError, EOFError):
                pass
        for process in self._procs:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self._conns:
            conn.close()

    def kill(self, rank: int) -> None:
        """Kill one worker, as a crash would (for tests and fault drills)."""
        self._procs[rank].kill()

    def _read(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                call_id, ok, value = conn.recv()
            except (EOFError, OSError):
                self._procs[rank].join(timeout=1)
                code = self._procs[rank].exitcode
                self._died(rank, "shut down" if self._closing else f"its process ended (exit code {code})")
                return
            self._watch.replied(rank)
            with self._lock:
                call = self._calls.get(call_id)
            if call is not None:
                call.reply(rank, ok, value)

    def _hung(self, rank: int, why: str) -> None:
        """A worker past its reply deadline: its calls fail with `why` first, then it is killed
        (its pipe then closes, and the reader finds it dead already)."""
        self._died(rank, why)
        self._procs[rank].kill()

    def _died(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self._dead:
                return
            self._dead[rank] = why
            pending = [c for c in self._calls.values() if rank in c.ranks]
        if not self._closing:
            log.error("the worker of device %d died: %s", rank, why)
        for call in pending:
            call.reply(rank, False, WorkerDied(rank, why))

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)


def _worker_main(rank: int, world: int, port: int, spec: WorkerSpec, collective_timeout_s: float, conn) -> None:
    """A worker process: join the world, load the model, serve calls."""
    import torch.distributed as dist

    become_child(f"gouache-dev-{rank}")  # the engine stops its workers itself
    device = f"cuda:{rank}" if spec.cuda else "cpu"  # worker i on cuda:i
    worker = join_world(rank, world, f"tcp://127.0.0.1:{port}", spec, device, collective_timeout_s)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            break
        if message is None:
            break
        call_id, method, args = message
        try:
            reply = (call_id, True, getattr(worker, method)(*args))
        except Exception as error:
            reply = (call_id, False, f"{type(error).__name__}: {error}")
        try:
            conn.send(reply)
        except (OSError, EOFError):
            break
    worker.runner.close()
    dist.destroy_process_group()
