"""The executor interface: how the engine reaches the workers of its devices.

`submit(method, args, ranks)` calls `Worker.<method>(*args)` on each of `ranks` at once and
returns a future of their results in rank order (`collective_rpc` waits for it). A batch of
degree k is one submit to its block's k ranks, which run it together. A worker that dies fails
every call pending on it with `WorkerDied` as soon as its executor notices (the pipe closing,
the actor dying), and stays in `dead()`.
"""

from __future__ import annotations

import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now: the rendezvous of a torch.distributed world."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
