"""Builds the FastAPI app around one engine, and runs it with uvicorn."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from gouache import __version__
from gouache.api import files, images, status
from gouache.api.body_limit import BodyLimitMiddleware
from gouache.api.context import ApiContext
from gouache.api.errors import install_error_handlers
from gouache.api.files import FileStore
from gouache.api.protocol import Limits

if TYPE_CHECKING:
    from gouache.api.engine import Engine
    from gouache.config import ServerConfig


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving a started `engine` under `config`'s limits; its state hangs off `app.state`."""
    app = FastAPI(title="gouache", version=__version__)
    limits = Limits.of(config, engine.info)
    app.state.gouache = ApiContext(engine=engine, config=config, limits=limits, files=FileStore(config.file_ttl_s))
    install_error_handlers(app, engine.metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, metrics=engine.metrics)
    for module in (images, files, status):
        app.include_router(module.router)
    return app


async def serve(engine: Engine, config: ServerConfig) -> None:
    """Start `engine` on this loop, serve until interrupted (Ctrl-C, SIGTERM), then close it."""
    await engine.start()
    try:
        server = uvicorn.Server(uvicorn.Config(create_app(engine, config), host=config.host, port=config.port))
        await server.serve()
    finally:
        await engine.aclose()


def run_server(engine: Engine, config: ServerConfig) -> None:
    """Blocking entry point of `gouache serve`; the engine is started and closed here."""
    asyncio.run(serve(engine, config))
