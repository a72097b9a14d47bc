"""Server-Sent Events of a streamed image request, in OpenAI's shape plus `gouache.progress`.

Events, for each of the n images (told apart by the gouache field `index`):
  gouache.progress                                 {"step", "total_steps", "index"} per step
  gouache.paused                                   {"step", "total_steps", "index"}: a higher service
                                                   tier took its slot; it resumes where it stopped
  image_generation.partial_image / image_edit...   {"b64_json", "partial_image_index", "index"}
  image_generation.completed / image_edit...       {"b64_json", "index", "seed"}
and `error` {"error": {message, type, param, code}} if the request fails.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.types import Receive, Scope, Send

from gouache.api.errors import error_body
from gouache.errors import CancelledError
from gouache.outputs import ErrorEvent, Event, ImageEvent, PartialImageEvent, PausedEvent, ProgressEvent

if TYPE_CHECKING:
    from gouache.engine.handle import RequestHandle
    from gouache.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamShape:
    """What every image event of one request repeats."""

    kind: str  # "image_generation" | "image_edit": the OpenAI event-name prefix
    size: str  # "WIDTHxHEIGHT"
    output_format: str  # png | jpeg | webp


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One event on the wire; its data is compact one-line JSON, as OpenAI sends."""
    return format_sse_event(data_str=json.dumps(data, separators=(",", ":")), event=event)


def encode_event(event: Event, shape: StreamShape) -> bytes:
    if isinstance(event, ProgressEvent | PausedEvent):
        name = "gouache.progress" if isinstance(event, ProgressEvent) else "gouache.paused"
        return sse(name, {"type": name, "step": event.step, "total_steps": event.total_steps, "index": event.index})
    if isinstance(event, ErrorEvent):
        return sse("error", {"type": "error", **error_body(event.message, event.status, event.kind)})
    common = {"created_at": int(time.time()), "size": shape.size, "output_format": shape.output_format}
    common |= {"background": "opaque", "quality": "auto", "index": event.index}
    b64 = base64.b64encode(event.image).decode()
    if isinstance(event, PartialImageEvent):
        name = f"{shape.kind}.partial_image"
        return sse(name, {"type": name, "b64_json": b64, "partial_image_index": event.partial_image_index, **common})
    name = f"{shape.kind}.completed"
    return sse(name, {"type": name, "b64_json": b64, "seed": event.seed, **common})


class ImageEventStream(EventSourceResponse):
    """The events of one request as SSE. However the response ends (all images sent, client gone,
    server error) `on_close` runs, which aborts the request unless it already finished."""

    def __init__(
        self,
        handle: RequestHandle,
        shape: StreamShape,
        metrics: Metrics,
        on_answered: Callable[[], None],
        on_close: Callable[[], None],
        headers: dict[str, str],
    ):
        """`on_answered` runs once every image was sent (it records the latency)."""
        self._metrics, self._on_answered, self._on_close = metrics, on_answered, on_close
        self._ended = False  # the request's own last event was sent
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        super().__init__(self._events(handle, shape), headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Cleanup lives here, not in the generator: a client that leaves before the first
        # chunk cancels the response before the generator ever starts.
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._ended:  # the client left first: its request is cancelled
                self._metrics.errors.labels(CancelledError.kind).inc()
            self._on_close()

    async def _events(self, handle: RequestHandle, shape: StreamShape) -> AsyncIterator[bytes]:
        try:
            images = 0
            async for event in handle:
                if isinstance(event, ErrorEvent):
                    self._metrics.errors.labels(event.kind).inc()
                images += isinstance(event, ImageEvent)
                self._ended = isinstance(event, ErrorEvent) or images == handle.n
                yield encode_event(event, shape)
            if images == handle.n:
                self._on_answered()
        except Exception:
            logger.exception("image stream %s failed", handle.request_id)
            self._metrics.errors.labels("server_error").inc()
            self._ended = True
            message = "The server had an error while processing your request."
            yield sse("error", {"type": "error", **error_body(message, 500, "server_error")})
