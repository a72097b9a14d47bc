"""Preparation and post-processing stages: each a FIFO served by one thread.

Both run beside the engine loop, never inside it: text encoding and VAE encode for new
requests, VAE decode (one request at a time) for finished ones and previews. Image codecs run
further out, in the worker processes of `imaging`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Stage:
    """One worker thread applying `handler` to jobs in arrival order."""

    def __init__(self, name: str, handler: Callable[..., None], on_error: Callable[[tuple, Exception], None]):
        self.handler = handler
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
        while (job := self.jobs.get()) is not None:
            try:
                self.handler(*job)
            except Exception as error:
                log.exception("stage job failed")
                self.on_error(job, error)
