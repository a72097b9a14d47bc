"""ASGI middleware answering 413 to bodies larger than `max_bytes`.

A declared Content-Length over the limit is refused before reading; a body without one (chunked)
is counted while the app reads it, and the read fails with PayloadTooLargeError when it passes
the limit, which the error handlers turn into a 413.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gouache.api.errors import error_response
from gouache.errors import GouacheError, InvalidRequestError, PayloadTooLargeError

if TYPE_CHECKING:
    from gouache.metrics import Metrics


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics):
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check_declared_length(scope)
        if error is not None:
            self.metrics.errors.labels(error.kind).inc()
            return await error_response(error)(scope, receive, send)
        await self.app(scope, self._counting(receive), send)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"The request body is larger than {self.max_bytes} bytes.")

    def _check_declared_length(self, scope: Scope) -> GouacheError | None:
        headers = dict(scope.get("headers", ()))
        declared = headers.get(b"content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            return InvalidRequestError("The Content-Length header is not a number.")
        return self._too_large() if int(declared) > self.max_bytes else None

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        return counting_receive
