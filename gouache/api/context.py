"""Per-app state the routes share, stored on `app.state` (no module globals)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from gouache.api.tenants import TenantBook

if TYPE_CHECKING:
    from gouache.api.engine import Engine
    from gouache.api.file_store import FileStore
    from gouache.api.request_fields import Limits
    from gouache.api.video_store import VideoStore
    from gouache.config import ServerConfig
    from gouache.engine.handle import RequestHandle


class InflightRequests:
    """API request id -> handle of requests not yet answered, so DELETE can abort them."""

    def __init__(self) -> None:
        self._handles: dict[str, RequestHandle] = {}
        self._ends: dict[str, Callable[[], None]] = {}

    def add(self, api_id: str, handle: RequestHandle, on_end: Callable[[], None] | None = None) -> None:
        """`on_end` runs once the request is answered (its tenant's slot is freed)."""
        self._handles[api_id] = handle
        if on_end is not None:
            self._ends[api_id] = on_end

    def finish(self, api_id: str) -> None:
        """Forget the request; abort it unless it already ended (abort is then a no-op)."""
        handle = self._handles.pop(api_id, None)
        if handle is not None:
            handle.abort()
        on_end = self._ends.pop(api_id, None)
        if on_end is not None:
            on_end()

    def abort(self, api_id: str) -> bool:
        """Abort a request still in flight; False if there is none with this id."""
        handle = self._handles.get(api_id)
        if handle is not None:
            handle.abort()
        return handle is not None

    def __len__(self) -> int:
        return len(self._handles)


@dataclass
class ApiContext:
    engine: Engine
    config: ServerConfig
    limits: Limits  # validation bounds from config and the served model
    files: FileStore  # images of response_format=url responses
    videos: VideoStore  # clips of the videos API, queued to expired
    model_ids: tuple[str, ...]  # names clients may pass as `model`; the first is the main one
    tenants: TenantBook = field(default_factory=TenantBook)  # API keys, their tiers and limits
    inflight: InflightRequests = field(default_factory=InflightRequests)
    started: int = field(default_factory=lambda: int(time.time()))  # unix seconds, for /v1/models

    @property
    def validation_context(self) -> dict[str, Limits]:
        return {"limits": self.limits}


def get_context(request: Request) -> ApiContext:
    """FastAPI dependency: the context `create_app` stored on the app."""
    return request.app.state.gouache
