"""The executor interface: how the engine reaches the workers of its devices.

`submit(method, args, ranks)` calls `Worker.<method>(*args)` on each of `ranks` at once and
returns a future of their results in rank order (`collective_rpc` waits for it). A batch of
degree k is one submit to its block's k ranks, which run it together. A worker that dies fails
every call pending on it with `WorkerDied` as soon as its executor notices (the pipe closing,
the actor dying), and stays in `dead()`. So does a worker that hangs: one that owes a reply and
sends none for the executor's reply deadline is killed (`ReplyWatch`), so no call waits forever.
"""

from __future__ import annotations

import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


class WorkerDied(RuntimeError):
    """A worker process (device) is gone; calls on it fail with this."""

    def __init__(self, rank: int, why: str = ""):
        super().__init__(f"the worker of device {rank} died" + (f": {why}" if why else ""))
        self.rank = rank


class Executor(ABC):
    kind: str
    num_devices: int

    @abstractmethod
    def submit(self, method: str, args: tuple = (), ranks: Sequence[int] | None = None) -> Future[list[Any]]:
        """Call `method(*args)` on the workers of `ranks` (all if None); a future of their
        results in the order of `ranks`. A worker's exception fails the future."""

    def collective_rpc(self, method: str, args: tuple = (), ranks: Sequence[int] | None = None,
                       timeout: float | None = None) -> list[Any]:
        return self.submit(method, args, ranks).result(timeout)

    def dead(self) -> set[int]:
        """The ranks whose workers died."""
        return set()

    def shutdown(self) -> None:
        """Stop the workers; calls pending fail."""


class Gather:
    """One submit: its future and the replies still awaited, by rank (for executors to fill in)."""

    def __init__(self, ranks: list[int]):
        self.future: Future[list[Any]] = Future()
        self.ranks = ranks
        self.results: dict[int, Any] = {}
        self.lock = threading.Lock()

    def reply(self, rank: int, ok: bool, value: Any) -> None:
        with self.lock:
            if self.future.done():
                return
            if not ok:
                self.future.set_exception(value if isinstance(value, BaseException) else RuntimeError(value))
                return
            self.results[rank] = value
            if len(self.results) == len(self.ranks):
                self.future.set_result([self.results[r] for r in self.ranks])


def open_gather(ranks: Sequence[int] | None, num_devices: int, lock: threading.Lock, dead: dict[int, str],
                register: Callable[[Gather], None] | None = None) -> Gather:
    """The Gather of one submit on `ranks` (all `num_devices` if None): failed at once with
    `WorkerDied` if any of them is in `dead` (rank -> why), else handed to `register`. Both under
    `lock`, the lock `dead` is written under, so that a worker dying meanwhile finds the call
    registered and fails it."""
    gather = Gather(list(range(num_devices)) if ranks is None else list(ranks))
    with lock:
        down = [r for r in gather.ranks if r in dead]
        if down:
            gather.reply(down[0], False, WorkerDied(down[0], dead[down[0]]))
        elif register is not None:
            register(gather)
    return gather


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now: the rendezvous of a torch.distributed world."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplyWatch:
    """Finds hung workers (alive, answering nothing): a worker that owes replies and has sent none
    for `deadline_s` seconds is reported to `on_hung(rank, why)`, once; the executor kills it and
    fails its calls with `WorkerDied`, as if it had died.

    A worker answers its calls in order, so silence runs from its last reply, or from the call
    that ended its last idle spell: a call queued behind a long one is not charged the wait, and
    a worker that keeps answering is never hung however much it owes. A worker waiting in a
    collective on a hung peer is silent too; it gives up at the collective timeout, which the
    deadline must exceed, else both would be taken for hung."""

    def __init__(self, num_workers: int, deadline_s: float, collective_timeout_s: float,
                 on_hung: Callable[[int, str], None]):
        if deadline_s <= collective_timeout_s:
            raise ValueError(f"the reply deadline ({deadline_s:g} s) must exceed the collective timeout "
                             f"({collective_timeout_s:g} s): a worker waiting in a collective on a hung peer "
                             "must give up before it is taken for hung too")
        self.deadline_s = deadline_s
        self.on_hung = on_hung
        self._owed = [0] * num_workers  # calls sent to each worker and not answered yet
        self._since = [0.0] * num_workers  # monotonic time each worker's silence began (read while it owes)
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gouache-reply-watch", daemon=True)

    def start(self) -> None:
        """Watch from now (after the workers' start, which has its own, longer, timeout)."""
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def sent(self, rank: int) -> None:
        """A call is about to go to `rank` (before it is sent, so that its reply comes after)."""
        with self._lock:
            if self._owed[rank] == 0:
                self._since[rank] = time.monotonic()
            self._owed[rank] += 1

    def replied(self, rank: int) -> None:
        with self._lock:
            self._owed[rank] -= 1
            self._since[rank] = time.monotonic()

    def hung(self, now: float) -> list[int]:
        """The workers silent past the deadline at `now` that were not reported yet (they are now)."""
        with self._lock:
            found = [rank for rank, owed in enumerate(self._owed)
                     if owed > 0 and rank not in self._reported and now - self._since[rank] > self.deadline_s]
            self._reported.update(found)
        return found

    def _watch(self) -> None:
        tick = min(1.0, self.deadline_s / 10)
        while not self._stopped.wait(tick):
            for rank in self.hung(time.monotonic()):
                self.on_hung(rank, f"it answered nothing for {self.deadline_s:g} s (hung) and was killed")
