"""Preparation and post-processing stages: each a FIFO served by one thread.

Both run beside the engine loop, never inside it: text encoding and VAE encode for new
requests, VAE decode for finished ones and previews (every job waiting when the stage gets to
them at once: one VAE call per latent shape). Image codecs run further out, in the worker
processes of `imaging`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from gouache.threads import single

log = logging.getLogger(__name__)


class Stage:
    """One worker thread applying `handler` to jobs in arrival order. A `batched` stage hands
    the handler every job waiting (a list of job tuples); if that raises, each job alone, so
    that only the jobs that fail alone fail."""

    def __init__(self, name: str, handler: Callable[..., None], on_error: Callable[[tuple, Exception], None],
                 batched: bool = False):
        self.handler = handler
        self.batched = batched
        self.on_error = on_error  # called with the job that raised; the stage goes on
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, *job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        single()  # the step thread is the one that runs torch on several threads (`gouache.threads`)
        while (job := self.jobs.get()) is not None:
            if not self.batched:
                self._one(job)
                continue
            jobs, stop = [job], False
            while not stop:
                try:
                    more = self.jobs.get_nowait()
                except queue.Empty:
                    break
                stop = more is None
                if not stop:
                    jobs.append(more)
            self._many(jobs)
            if stop:
                break

    def _one(self, job: tuple) -> None:
        try:
            self.handler([job]) if self.batched else self.handler(*job)
        except Exception as error:
            log.exception("stage job failed")
            self.on_error(job, error)

    def _many(self, jobs: list[tuple]) -> None:
        if len(jobs) == 1:
            self._one(jobs[0])
            return
        try:
            self.handler(jobs)
        except Exception:
            log.exception("a batch of %d stage jobs failed; running them one by one", len(jobs))
            for job in jobs:
                self._one(job)
