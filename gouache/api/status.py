"""GET /v1/models, /health and /metrics: what is served and how busy it is."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from gouache.api.context import ApiContext, get_context
from gouache.api.protocol import ModelCard, ModelList
from gouache.errors import UnknownModelError

router = APIRouter()


def _model_card(ctx: ApiContext) -> ModelCard:
    return ModelCard(id=ctx.engine.info.name, created=ctx.started)


@router.get("/v1/models")
async def list_models(ctx: ApiContext = Depends(get_context)) -> ModelList:
    return ModelList(data=[_model_card(ctx)])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: ApiContext = Depends(get_context)) -> ModelCard:
    if model_id != ctx.engine.info.name:
        raise UnknownModelError(f"The model '{model_id}' does not exist.", "model")
    return _model_card(ctx)


@router.get("/health")
async def health(ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    stats = ctx.engine.stats()
    return {"status": "ok", "model": ctx.engine.info.name, "waiting": stats.waiting, "running": stats.running}


@router.get("/metrics")
async def metrics(ctx: ApiContext = Depends(get_context)) -> Response:
    stats, engine_metrics = ctx.engine.stats(), ctx.engine.metrics
    engine_metrics.queue_length.set(stats.waiting)
    engine_metrics.running_batch.set(stats.running)
    return Response(engine_metrics.render(), media_type=CONTENT_TYPE_LATEST)
