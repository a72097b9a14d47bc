"""GET /v1/models, /health, /v1/status and /metrics: what is served and how busy it is."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from gouache.api.context import ApiContext, get_context
from gouache.errors import UnknownModelError
from gouache.model_info import ModelInfo, shown

router = APIRouter()


class Clips(BaseModel):
    """A video model's clips (docs/video.md)."""

    frame_step: int  # frames are 1 + a multiple of this
    max_frames: int
    fps: int  # frames per second when a request names none
    from_image: bool = False  # image-to-video: each request sends its first frame (`input_reference`)


class RequestKinds(BaseModel):
    """What a model takes (docs/edits.md, docs/video.md): generations, which edits, or clips."""

    generation: bool = True  # /v1/images/generations (Qwen-Image-Edit's pipelines edit only)
    masked_edit: bool = True  # /v1/images/edits with a mask repaints its region
    instruction_edit: bool  # an edit without a mask is redrawn as its prompt says
    max_input_images: int  # image[] uploads one edit takes
    img2img: bool  # an edit without a mask takes `strength`
    video: Clips | None = None  # /v1/videos makes its clips (and the image routes refuse it); None: images

    @classmethod
    def of(cls, info: ModelInfo) -> RequestKinds:
        if info.clips is not None:  # text to video: no image route, no edit
            return cls(generation=False, masked_edit=False, instruction_edit=False, max_input_images=0,
                       img2img=False, video=Clips(**asdict(info.clips)))
        return cls(generation=info.generation, instruction_edit=info.instruction_edit,
                   max_input_images=info.max_input_images, img2img=info.img2img)


class ModelDefaults(BaseModel):
    """gouache's extension of a model card: the defaults and bounds a request form needs."""

    family: str  # sd | sdxl | sd3 | flux | qwenimage | zimage | flux2 | wan
    default_size: int  # pixels per side when a request names no size
    size_step: int  # width and height must be multiples of this
    min_size: int
    max_size: int
    max_pixels: int
    # "WxH" (a clip's "WxHxF"): the only sizes this server prices, when its cost model restricts them
    sizes: list[str] | None
    default_steps: int
    max_steps: int
    default_guidance: float
    uses_cfg: bool  # a negative prompt and guidance mean something
    max_n: int
    max_batch: int | None  # requests denoised together in one step (measured at start under --max-batch-size auto)
    kinds: RequestKinds
    # techniques (request fields' names in docs/architecture.md) the model does not serve, and why
    unserved: dict[str, str]

    @classmethod
    def of(cls, ctx: ApiContext) -> ModelDefaults:
        info, limits = ctx.engine.info, ctx.limits
        sizes = None if limits.sizes is None else [shown(res) for res in limits.sizes]
        return cls(family=info.family, default_size=limits.default_size, size_step=limits.size_step,
                   min_size=limits.min_size, max_size=limits.max_size, max_pixels=limits.max_pixels, sizes=sizes,
                   default_steps=info.default_steps, max_steps=limits.max_steps,
                   default_guidance=info.default_guidance, uses_cfg=info.uses_cfg, max_n=limits.max_n,
                   max_batch=info.max_batch, kinds=RequestKinds.of(info), unserved=dict(info.unserved))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gouache"
    gouache: ModelDefaults


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("/v1/models")
async def list_models(ctx: ApiContext = Depends(get_context)) -> ModelList:
    defaults = ModelDefaults.of(ctx)
    return ModelList(data=[ModelCard(id=name, created=ctx.started, gouache=defaults) for name in ctx.model_ids])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: ApiContext = Depends(get_context)) -> ModelCard:
    if model_id not in ctx.model_ids:
        raise UnknownModelError(f"The model '{model_id}' does not exist.", "model")
    return ModelCard(id=model_id, created=ctx.started, gouache=ModelDefaults.of(ctx))


@router.get("/health")
async def health(ctx: ApiContext = Depends(get_context)) -> JSONResponse:
    """200 while serving; 503 while draining for a shutdown or once the engine loop died."""
    stats = ctx.engine.stats()
    body = {"status": stats.status, "model": ctx.model_ids[0], "waiting": stats.waiting, "running": stats.running}
    return JSONResponse(body, status_code=200 if stats.status == "ok" else 503)


@router.get("/v1/status")
async def status(ctx: ApiContext = Depends(get_context)) -> dict:
    """The queue, each request's size and step, recent step latency and overhead, images per
    second, the last step of each device block (per replica under --replicas), and the errors
    answered since start by kind."""
    return {**await ctx.engine.status(), "errors": ctx.engine.metrics.error_counts()}


@router.get("/metrics")
async def metrics(ctx: ApiContext = Depends(get_context)) -> Response:
    return Response(await ctx.engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)
