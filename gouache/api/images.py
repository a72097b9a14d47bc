"""POST /v1/images/generations, POST /v1/images/edits, DELETE /v1/images/requests/{id} and
POST /v1/templates.

Each image request gets an API id, returned in `x-request-id` (also on errors and streams),
which DELETE takes to abort it. A request ends (and is aborted unless it finished) when its
response is sent, its stream closes, or its client disconnects.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import FormData, UploadFile

from gouache.api.context import ApiContext, get_context
from gouache.api.errors import NotFoundError
from gouache.api.openapi import form_body, json_body
from gouache.api.protocol import (
    MEDIA_TYPES,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageParams,
    ImagesResponse,
    PromptParams,
)
from gouache.api.request_fields import IGNORED_FIELDS
from gouache.api.streaming import ImageEventStream, StreamShape
from gouache.api.tenants import ANONYMOUS, Tenant
from gouache.engine.imaging import DecodeError, read_size
from gouache.errors import CancelledError, InvalidRequestError, TenantLimitError, UnknownModelError
from gouache.outputs import ImageEvent

if TYPE_CHECKING:
    from gouache.engine.handle import RequestHandle
    from gouache.request import ImageRequest

router = APIRouter()
logger = logging.getLogger(__name__)

_FILE_FIELDS = ("image", "image[]", "mask")
_MAX_FORM_FIELDS = 64  # far more than the API has; stops field floods before validation
# edit fields a template registration would ignore (it returns no image and uses no block cache)
_NOT_FOR_TEMPLATES = ("mask", "n", "stream", "partial_images", "template_cache", "response_format", "output_format",
                      "output_compression", "block_cache", "strength")
_UPLOADS = {"image": "the image to edit (PNG, JPEG or WebP); `image[]` too, for models that take several",
            "mask": "where to repaint (OpenAI's rule): its fully transparent pixels, or without transparency its "
                    "white ones"}


@router.post("/v1/images/generations", openapi_extra=json_body(ImageGenerationRequest))
async def create_images(request: Request, ctx: ApiContext = Depends(get_context)) -> Response:
    arrival, api_id = _start(request)
    # curl -d sends JSON labelled as a form; accept it so the one-line curl example works
    require_content_type(request, "application/json", also=("", "application/x-www-form-urlencoded"))
    body = await request.body()
    params = ImageGenerationRequest.model_validate_json(body, strict=True, context=ctx.validation_context)
    _log_ignored(params)
    return await _serve(request, ctx, params, api_id, arrival, "image_generation")


@router.post("/v1/images/edits", openapi_extra=form_body(ImageEditRequest, _UPLOADS, ("image",)))
async def edit_images(request: Request, ctx: ApiContext = Depends(get_context)) -> Response:
    arrival, api_id = _start(request)
    require_content_type(request, "multipart/form-data")
    form = await request.form(max_files=8, max_fields=_MAX_FORM_FIELDS)
    images = [await read_upload(value, "image") for name in ("image", "image[]") for value in form.getlist(name)]
    if not images:
        raise InvalidRequestError("Missing required parameter: 'image'.", "image")
    image, references = images[0], images[1:]  # models that take several images read the others as references
    mask_field = _only_upload(form, ("mask",), "mask")
    mask = None if mask_field is None else await read_upload(mask_field, "mask")
    params = ImageEditRequest.model_validate(text_fields(form), context=ctx.validation_context)
    _log_ignored(params)
    if params.size == "auto":
        params = params.at_upload_size(*_upload_size(image), ctx.limits)
    return await _serve(request, ctx, params, api_id, arrival, "image_edit", image, mask, tuple(references))


@router.post("/v1/templates", openapi_extra=form_body(ImageEditRequest, {"image": _UPLOADS["image"]}, ("image",),
                                                     leave_out=_NOT_FOR_TEMPLATES))
async def register_template(request: Request, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    """Record a template's activations ahead of its edits (docs/edits.md): an edit's form without
    a mask (the image, the prompt describing it, the size, steps and guidance its edits will use:
    a template serves edits of the same size, step count and guidance on/off). The engine
    denoises the image with every token kept; the answer names the template for `template_id`."""
    arrival, api_id = _start(request)
    require_content_type(request, "multipart/form-data")
    form = await request.form(max_files=8, max_fields=_MAX_FORM_FIELDS)
    sent = next((name for name in _NOT_FOR_TEMPLATES if name in form), None)
    if sent is not None:
        raise InvalidRequestError(f"Invalid value for '{sent}': a template is recorded whole, once, and answers "
                                  "with its id, not an image; leave it out.", sent)
    image = await read_upload(_only_upload(form, ("image", "image[]"), "image"), "image")
    params = ImageEditRequest.model_validate({**text_fields(form), "template_cache": "true"},
                                             context=ctx.validation_context)
    if params.size == "auto":
        params = params.at_upload_size(*_upload_size(image), ctx.limits)
    check_model(ctx, params)
    tenant = tenant_of(request)
    [job] = params.to_requests(api_id, ctx.engine.info, arrival, image, tenant=tenant, register_template=True)
    handle = await submit(ctx, tenant, [job])
    ctx.inflight.add(api_id, handle, lambda: ctx.tenants.release(tenant))
    try:
        await _images_unless_disconnected(request, handle.images())
    finally:
        ctx.inflight.finish(api_id)
    return {"id": job.template_id, "object": "template", "size": params.size,
            "num_inference_steps": job.num_inference_steps, "guidance_scale": job.guidance_scale}


@router.delete("/v1/images/requests/{request_id}")
async def cancel_request(request_id: str, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    if not ctx.inflight.abort(request_id):
        raise NotFoundError(f"No request '{request_id}' is in flight.", "request_id")
    return {"id": request_id, "object": "image.request", "status": "cancelled"}


def _start(request: Request) -> tuple[float, str]:
    """Arrival time (for SLOs and latency) and a fresh API id, remembered for error responses."""
    request.state.request_id = "img_" + secrets.token_hex(12)
    return time.monotonic(), request.state.request_id


def require_content_type(request: Request, expected: str, also: tuple[str, ...] = ()) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != expected and media_type not in also:
        got = f"'{media_type}'" if media_type else "none"
        raise InvalidRequestError(f"Content-Type must be {expected}, got {got}.")


async def _serve(
    request: Request,
    ctx: ApiContext,
    params: ImageParams,
    api_id: str,
    arrival: float,
    kind: str,
    image: bytes | None = None,
    mask: bytes | None = None,
    references: tuple[bytes, ...] = (),
) -> Response:
    check_model(ctx, params)
    tenant = tenant_of(request)
    jobs = params.to_requests(api_id, ctx.engine.info, arrival, image, mask, references, tenant)
    handle = await submit(ctx, tenant, jobs)
    ctx.inflight.add(api_id, handle, lambda: ctx.tenants.release(tenant))
    headers = {"x-request-id": api_id}
    answered = functools.partial(_observe_latency, ctx, jobs[0].tier.label, arrival)
    if params.stream:
        shape = StreamShape(kind, params.size, params.output_format)
        on_close = lambda: ctx.inflight.finish(api_id)  # noqa: E731
        return ImageEventStream(handle, shape, ctx.engine.metrics, answered, on_close, headers)
    try:
        events = await _images_unless_disconnected(request, handle.images())
    finally:
        ctx.inflight.finish(api_id)
    answered()
    body = _images_response(request, ctx, params, events).model_dump(exclude_none=True)
    return JSONResponse(body, headers=headers)


def _observe_latency(ctx: ApiContext, tier: str, arrival: float) -> None:
    """A request's images were all sent: its latency, in all and by its service tier."""
    latency = time.monotonic() - arrival
    ctx.engine.metrics.request_latency.observe(latency)
    ctx.engine.metrics.tier_latency.labels(tier).observe(latency)


def tenant_of(request: Request) -> Tenant:
    """Whose key sent the request (`ApiKeyMiddleware`); the anonymous tenant on an open server."""
    return getattr(request.state, "tenant", ANONYMOUS)


async def submit(ctx: ApiContext, tenant: Tenant, jobs: list[ImageRequest]) -> RequestHandle:
    """Submit a request within its tenant's limits (429 past them, the others unaffected); the
    caller frees its slot when it is answered. Counted by tenant, tier and result."""
    count = ctx.engine.metrics.tenant_requests.labels
    tier = jobs[0].tier.label
    try:
        ctx.tenants.acquire(tenant)
    except TenantLimitError:
        count(tenant.name, tier, "limited").inc()
        raise
    try:
        handle = await ctx.engine.submit(jobs)
    except BaseException:
        ctx.tenants.release(tenant)
        raise
    count(tenant.name, tier, "accepted").inc()
    return handle


def check_model(ctx: ApiContext, params: PromptParams) -> None:
    if params.model is not None and params.model not in ctx.model_ids:
        message = (f"The model '{params.model}' does not exist; "
                   f"this server serves {', '.join(map(repr, ctx.model_ids))}.")
        raise UnknownModelError(message, "model")


async def _images_unless_disconnected(
    request: Request, images: Coroutine[Any, Any, list[ImageEvent]]
) -> list[ImageEvent]:
    """Await the images, or raise CancelledError as soon as the client disconnects."""
    images_task = asyncio.ensure_future(images)
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((images_task, gone_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone_task.cancel()
        images_task.cancel()  # a no-op once it is done
    if images_task.done() and not images_task.cancelled():
        return images_task.result()
    raise CancelledError("The client disconnected.")


async def _disconnected(request: Request) -> None:
    # The body has been read, so the only message left to receive is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _images_response(
    request: Request, ctx: ApiContext, params: ImageParams, events: list[ImageEvent]
) -> ImagesResponse:
    media_type = MEDIA_TYPES[params.output_format]
    if params.response_format == "url":
        urls = [str(request.url_for("get_file", file_id=ctx.files.put(e.image, media_type))) for e in events]
        data = [ImageData(url=url, seed=e.seed) for url, e in zip(urls, events)]
    else:
        data = [ImageData(b64_json=base64.b64encode(e.image).decode(), seed=e.seed) for e in events]
    return ImagesResponse(created=int(time.time()), data=data, output_format=params.output_format, size=params.size)


def _only_upload(form: FormData, names: tuple[str, ...], param: str) -> UploadFile | str | None:
    """The one value sent under any of `names`, if any: more than one is refused rather than all
    but the first dropped (an edit's several images are read apart, by `edit_images`)."""
    values = [value for name in names for value in form.getlist(name)]
    if len(values) > 1:
        raise InvalidRequestError(f"Invalid value for '{param}': {len(values)} files were sent; "
                                  f"an edit takes one {param}.", param)
    return values[0] if values else None


def _upload_size(image: bytes) -> tuple[int, int]:
    size = read_size(image, "image")
    if isinstance(size, DecodeError):
        raise InvalidRequestError(size.message, size.param)
    return size


def _log_ignored(params: ImageParams) -> None:
    for name in params.ignored_fields():
        _log_ignored_once(name)


@functools.cache  # once per field name and process: an operator needs to know, not to be flooded
def _log_ignored_once(name: str) -> None:
    logger.warning("field %s is accepted and ignored: %s", name, IGNORED_FIELDS[name])


async def read_upload(value: UploadFile | str | None, param: str) -> bytes:
    """The bytes of an uploaded file, still encoded: decoding is the engine's job."""
    if value is None:
        raise InvalidRequestError(f"Missing required parameter: '{param}'.", param)
    if isinstance(value, str):
        raise InvalidRequestError(f"Invalid value for '{param}': must be a file upload, not a text field.", param)
    data = await value.read()
    if not data:
        raise InvalidRequestError(f"Invalid value for '{param}': the uploaded file is empty.", param)
    return data


def text_fields(form: FormData, files: tuple[str, ...] = _FILE_FIELDS) -> dict[str, str]:
    """A form's text fields (the first of each name), its `files` left out; a file elsewhere is a 400."""
    fields: dict[str, str] = {}
    for name, value in form.multi_items():
        if name in files:
            continue
        if not isinstance(value, str):
            raise InvalidRequestError(f"Invalid value for '{name}': must be a text field, not a file.", name)
        fields.setdefault(name, value)
    return fields
