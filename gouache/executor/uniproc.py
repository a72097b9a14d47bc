"""`uniproc`: the one worker runs in the engine's process, on the driver's own model runner."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from gouache.executor.base import Executor
from gouache.executor.worker import Worker
from gouache.runner.model_runner import ModelRunner


class UniprocExecutor(Executor):
    """One device, no process boundary: a call runs at once in the caller's thread."""

    kind = "uniproc"
    num_devices = 1

    def __init__(self, runner: ModelRunner):
        self.worker = Worker(0, runner)

    def submit(self, method: str, args: tuple = (), ranks: Sequence[int] | None = None) -> Future[list[Any]]:
        if ranks is not None and list(ranks) != [0]:
            raise ValueError(f"the uniproc executor has device 0 only, not {list(ranks)}")
        future: Future[list[Any]] = Future()
        try:
            future.set_result([getattr(self.worker, method)(*args)])
        except Exception as error:
            future.set_exception(error)
        return future
