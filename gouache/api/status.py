"""GET /v1/models, /health, /v1/status and /metrics: what is served and how busy it is."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gouache.api.context import ApiContext, get_context
from gouache.api.protocol import ModelCard, ModelList
from gouache.errors import UnknownModelError

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: ApiContext = Depends(get_context)) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=ctx.started) for name in ctx.model_ids])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: ApiContext = Depends(get_context)) -> ModelCard:
    if model_id not in ctx.model_ids:
        raise UnknownModelError(f"The model '{model_id}' does not exist.", "model")
    return ModelCard(id=model_id, created=ctx.started)


@router.get("/health")
async def health(ctx: ApiContext = Depends(get_context)) -> JSONResponse:
    """200 while serving; 503 while draining for a shutdown or once the engine loop died."""
    stats = ctx.engine.stats()
    body = {"status": stats.status, "model": ctx.model_ids[0], "waiting": stats.waiting, "running": stats.running}
    return JSONResponse(body, status_code=200 if stats.status == "ok" else 503)


@router.get("/v1/status")
async def status(ctx: ApiContext = Depends(get_context)) -> dict:
    """The queue, each request's size and step, recent step latency and overhead, images per
    second, the last step of each device block; per replica under --replicas."""
    return await ctx.engine.status()


@router.get("/metrics")
async def metrics(ctx: ApiContext = Depends(get_context)) -> Response:
    return Response(await ctx.engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)
