"""What the API needs from an engine. The real one lives in `gouache.engine`; tests use a fake."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio

    from gouache.engine.handle import RequestHandle
    from gouache.metrics import Metrics
    from gouache.model_info import ModelInfo
    from gouache.outputs import EngineStats
    from gouache.request import ImageRequest


class Engine(Protocol):
    info: ModelInfo  # the served model: its name and size rules
    metrics: Metrics  # the API counts errors and request latency here
    died: asyncio.Event | None  # set once started, if the engine loop dies; the server then exits

    async def submit(self, requests: list[ImageRequest]) -> RequestHandle:
        """Accept all n images of one API request (ids "<api id>-<i>", seeds base + i).

        Raises InvalidRequestError (bad upload; `.param` names the field), QueueFullError,
        ShuttingDownError or EngineStoppedError.
        """
        ...

    async def list_loras(self) -> list[dict]:
        """The adapters of --lora-dir, each `{id, object: "lora", file_bytes, loaded, ...}`."""
        ...

    async def register_lora(self, name: str) -> dict:
        """Check adapter `name` against the model and read it into host memory; what the listing
        says of it. Raises InvalidRequestError for a name, file or shape that does not fit."""
        ...

    def stats(self) -> EngineStats: ...

    async def render_metrics(self) -> bytes:
        """GET /metrics's body: `metrics` and the engine's own, in the text exposition format."""
        ...

    async def start(self) -> None:
        """Start serving on the running loop (handles push events onto it); run_server calls it."""
        ...

    async def drain(self, grace_s: float) -> None:
        """Admit nothing more; let what is in flight finish for up to `grace_s` seconds, then fail
        the rest with ShuttingDownError. The server calls it on SIGTERM / SIGINT."""
        ...

    async def aclose(self) -> None:
        """Fail what is in flight with EngineStoppedError and stop; run_server calls it on exit."""
        ...
