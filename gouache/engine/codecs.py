"""The process pool that runs image codecs (`imaging`), kept alive whatever happens to a worker.

A worker that dies (killed, out of memory) breaks a `ProcessPoolExecutor` for good: every
pending job fails and every later submit raises. `CodecPool` replaces a broken pool at once and
runs each job that the break took down once more on the new pool, so one dead worker costs at
most the job it was running (if that job kills its worker again). Workers ignore SIGINT and
SIGTERM: a signal to the whole process group (Ctrl-C, a container stop) is the server's to
handle, and the server shuts the pool down itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from gouache.children import become_child

log = logging.getLogger(__name__)

RETRIES = 1  # runs of a job on a fresh pool after a worker died under it


class CodecPool:
    def __init__(self, workers: int):
        self.workers = workers
        self.replaced = 0  # pools replaced after a worker died
        self._lock = threading.Lock()
        self._pool = self._new_pool()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) in a worker; the future fails only if the job fails (or kills its
        worker on every try)."""
        result: Future = Future()
        result.set_running_or_notify_cancel()
        self._run(result, fn, args, RETRIES)
        return result

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for running ones and for every worker process to exit."""
        with self._lock:
            pool = self._pool
        pool.shutdown(wait=True, cancel_futures=True)

    def _new_pool(self) -> ProcessPoolExecutor:
        # Spawned, not forked from `children.processes`' server: a codec worker needs PIL and numpy,
        # not the torch and diffusers that server imports first (7 s of a 2-core CPU).
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.workers, mp_context=context, initializer=become_child,
                                   initargs=("gouache-codec",))

    def _run(self, result: Future, fn: Callable[..., Any], args: tuple, retries: int) -> None:
        with self._lock:
            pool = self._pool
        try:
            job = pool.submit(fn, *args)
        except BrokenProcessPool as error:
            self._replace(pool)
            if retries > 0:
                self._run(result, fn, args, retries - 1)
            else:
                result.set_exception(error)
            return
        except RuntimeError as error:  # submitted after shutdown
            result.set_exception(error)
            return
        job.add_done_callback(lambda done: self._settle(result, done, pool, fn, args, retries))

    def _settle(self, result: Future, job: Future, pool: ProcessPoolExecutor, fn, args: tuple, retries: int) -> None:
        if job.cancelled():
            result.set_exception(RuntimeError("the image job was cancelled: the server is shutting down"))
            return
        error = job.exception()
        if isinstance(error, BrokenProcessPool):
            self._replace(pool)
            if retries > 0:
                self._run(result, fn, args, retries - 1)
                return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(job.result())

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not broken:  # another job's failure replaced it already
                return
            self._pool = self._new_pool()
            self.replaced += 1
        log.warning("an image worker process died; its pool was replaced")
        broken.shutdown(wait=False, cancel_futures=True)
