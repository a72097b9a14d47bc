"""The asyncio side of one API request: a stream of events for its n images."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gouache.errors import GouacheError
from gouache.outputs import ErrorEvent, Event, ImageEvent


@dataclass
class EngineStats:
    """A snapshot for /health and /metrics."""

    waiting: int  # requests accepted but not yet denoising (preparing or queued)
    running: int  # requests in the denoising batch
    finished: int  # images returned since start
    failed: int  # images that ended with an error since start


class RequestHandle:
    """Events of one API request (its n images), fed from the engine thread.

    Iterating yields ProgressEvent / PartialImageEvent / ImageEvent as they happen and stops
    after the n-th ImageEvent or the first ErrorEvent.
    """

    def __init__(self, request_id: str, n: int, loop: asyncio.AbstractEventLoop, on_abort: Callable[[], None]):
        self.request_id = request_id
        self.n = n
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_abort = on_abort
        self._closed = False

    def push(self, event: Event) -> None:
        """Thread-safe: called by the engine from any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def __aiter__(self) -> AsyncIterator[Event]:
        images = 0
        while not self._closed:
            event = await self._queue.get()
            yield event
            if isinstance(event, ErrorEvent):
                self._closed = True
            elif isinstance(event, ImageEvent):
                images += 1
                self._closed = images >= self.n

    async def images(self) -> list[ImageEvent]:
        """Wait for all n images, ordered by index; raise the error if the request failed."""
        done: list[ImageEvent] = []
        async for event in self:
            if isinstance(event, ErrorEvent):
                error = GouacheError(event.message)
                error.kind, error.status = event.kind, event.status
                raise error
            if isinstance(event, ImageEvent):
                done.append(event)
        return sorted(done, key=lambda e: e.index)

    def abort(self) -> None:
        """Stop all n images; the engine frees their slots within one step."""
        if not self._closed:
            self._closed = True
            self._on_abort()
