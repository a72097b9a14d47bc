"""The asyncio side of one API request: a stream of events for its n images."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from gouache.errors import CancelledError, GouacheError
from gouache.outputs import ErrorEvent, Event, ImageEvent


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
        # Ends on the request's own last event, never on `_closed` alone: after abort() the
        # consumer still drains what was queued and then gets abort's `cancelled` ErrorEvent, so
        # it neither hangs in get() nor returns fewer than n images without an error.
        images = 0
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, ImageEvent):
                images += 1
            if isinstance(event, ErrorEvent) or images >= self.n:
                self._closed = True
                return

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
        """Stop all n images; the engine frees their slots within one step.

        A no-op once the request has ended. Otherwise iteration ends with a `cancelled`
        ErrorEvent (and images() raises), whether or not the engine pushes one too.
        """
        if not self._closed:
            self._closed = True
            self._on_abort()
            self.push(ErrorEvent(CancelledError.kind, "The request was cancelled.", CancelledError.status))
