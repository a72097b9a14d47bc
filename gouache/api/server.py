"""Builds the FastAPI app around one engine, and runs it with uvicorn until a signal or the
engine's death ends it.

Shutdown (SIGTERM or SIGINT, to the server or to its whole process group): the server stops
admitting (503 with Retry-After, /health 503 "draining", the port stays open so clients get an
answer), gives running requests `shutdown_grace_s` to finish, cancels the rest with an explicit
error, then stops uvicorn, the engine's threads and its codec processes, and exits 0. A second
signal skips the grace. If the engine loop dies, /health turns 503 and the server exits 1, so
that a process manager restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from gouache import __version__
from gouache.api import adapters, files, images, openapi, page, status, videos
from gouache.api.auth import ApiKeyMiddleware
from gouache.api.body_limit import BodyLimitMiddleware
from gouache.api.context import ApiContext
from gouache.api.errors import install_error_handlers
from gouache.api.file_store import FileStore
from gouache.api.protocol import ImageGenerationRequest
from gouache.api.request_fields import Limits
from gouache.api.tenants import TenantBook
from gouache.api.video_store import VideoStore

if TYPE_CHECKING:
    from types import FrameType

    from gouache.api.engine import Engine
    from gouache.config import ServerConfig

log = logging.getLogger(__name__)

ENGINE_DIED = 1  # exit status when the engine loop died


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving a started `engine` under `config`'s limits; its state hangs off `app.state`."""
    app = FastAPI(title="gouache", version=__version__)
    limits = Limits.of(config, engine.info)
    model_ids = config.served_model_names or (engine.info.name,)
    tenants = TenantBook.of(config.api_key, config.api_keys_file)
    app.state.gouache = ApiContext(engine=engine, config=config, limits=limits, files=FileStore(config.file_ttl_s),
                                   videos=VideoStore(config.file_ttl_s), model_ids=model_ids, tenants=tenants)
    install_error_handlers(app, engine.metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, metrics=engine.metrics)
    if not tenants.open:  # outermost: an unauthenticated request is refused before anything else
        app.add_middleware(ApiKeyMiddleware, tenants=tenants, metrics=engine.metrics)
    for module in (images, videos, files, adapters, status, page):
        app.include_router(module.router)
    app.mount("/ui", page.static_files(), name="ui")
    openapi.install(app, (ImageGenerationRequest,))
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn with gouache's shutdown: drain the engine first, then let uvicorn stop."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler. Unlike uvicorn's own it does not re-raise the signal after
        # the shutdown, which would end the process with a KeyboardInterrupt traceback.
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self._draining is None:
            log.info("%s: draining (up to %g s), then exiting; send it again to skip the grace", name, self.grace_s)
            self._draining = self._loop.create_task(self.shut_down(self.grace_s))
        elif not self.should_exit:
            log.info("%s again: cancelling what is in flight", name)
            self._loop.create_task(self.shut_down(0.0))
        else:
            self.force_exit = True

    async def shut_down(self, grace_s: float) -> None:
        await self.engine.drain(grace_s)
        await asyncio.sleep(0.2)  # let the handlers send the answers the drain produced
        self.should_exit = True

    async def exit_when_engine_dies(self) -> None:
        await self.engine.died.wait()
        log.critical("the engine loop died; exiting with status %d so that it is restarted", ENGINE_DIED)
        self.exit_code = ENGINE_DIED
        await asyncio.sleep(0.2)
        self.should_exit = True


async def serve(engine: Engine, config: ServerConfig) -> int:
    """Start `engine` on this loop, serve until a signal or the engine's death, then close it.
    Returns the process's exit status."""
    await engine.start()
    try:
        app = create_app(engine, config)
        if config.api_keys_file is not None:  # `kill -HUP` reloads the tenants' keys and limits
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, app.state.gouache.tenants.reload)
        uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port)
        server = GracefulServer(uvicorn_config, engine, config.shutdown_grace_s)
        watchdog = asyncio.create_task(server.exit_when_engine_dies())
        host = f"[{config.host}]" if ":" in config.host else config.host
        log.info("playground and status page: http://%s:%d/", host, config.port)
        await server.serve()
        watchdog.cancel()
    finally:
        await engine.aclose()
    return server.exit_code


def run_server(engine: Engine, config: ServerConfig) -> int:
    """Blocking entry point of `gouache serve`; the engine is started and closed here."""
    return asyncio.run(serve(engine, config))
