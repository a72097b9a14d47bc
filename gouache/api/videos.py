"""OpenAI's videos API: POST /v1/videos makes a clip in the background and answers at once with
a video object (`queued`); GET /v1/videos/{id} says its status and progress, GET /v1/videos lists
them (paged), GET /v1/videos/{id}/content downloads the MP4 (or `variant=thumbnail`, its first
frame as WebP), GET /v1/videos/{id}/events streams its progress and previews (gouache's),
DELETE /v1/videos/{id} cancels a running one (its slot freed within a step) and forgets it.
Finished clips are kept for `--file-ttl-s` within a byte budget, oldest dropped first, as `url`
images are.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import FormData

from gouache.api.context import ApiContext, get_context
from gouache.api.errors import NotFoundError
from gouache.api.images import check_model, read_upload, require_content_type, submit, tenant_of, text_fields
from gouache.api.protocol import VideoCreateRequest
from gouache.api.streaming import sse
from gouache.api.video_store import Video
from gouache.errors import InvalidRequestError
from gouache.model_info import ModelInfo
from gouache.outputs import ErrorEvent, ImageEvent, PartialImageEvent, ProgressEvent

if TYPE_CHECKING:
    from gouache.engine.handle import RequestHandle

router = APIRouter()

MAX_LIST = 100  # videos one page of GET /v1/videos lists at most
_MAX_FORM_FIELDS = 64
MEDIA = {"video": "video/mp4", "thumbnail": "image/webp"}


@router.post("/v1/videos")
async def create_video(request: Request, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    arrival = time.monotonic()
    video_id = request.state.request_id = "video_" + secrets.token_hex(12)
    require_content_type(request, "multipart/form-data", also=("application/json",))
    if request.headers.get("content-type", "").startswith("application/json"):
        fields, strict = _json_object(await request.body()), True
        reference = _reference_object(fields.pop("input_reference", None), ctx)
    else:  # OpenAI's client: a form, every field text
        form = await request.form(max_files=1, max_fields=_MAX_FORM_FIELDS)
        fields, strict = text_fields(form, files=("input_reference",)), False
        reference = await _form_reference(form, fields, ctx)
    params = VideoCreateRequest.model_validate(fields, strict=strict, context=ctx.validation_context)
    check_model(ctx, params)
    _check_reference(ctx.engine.info, reference)
    tenant = tenant_of(request)
    job = replace(params.to_request(video_id, ctx.engine.info, arrival, tenant), image=reference)
    handle = await submit(ctx, tenant, [job])
    ctx.inflight.add(video_id, handle, lambda: ctx.tenants.release(tenant))
    video = Video(video_id, ctx.model_ids[0], params.prompt, f"{job.width}x{job.height}", job.num_frames, job.fps,
                  job.seed, tenant.name, created_at=int(time.time()))
    ctx.videos.add(video)
    video.follower = asyncio.create_task(_follow(ctx, video, handle))
    return video.body()


async def _follow(ctx: ApiContext, video: Video, handle: RequestHandle) -> None:
    """Keep `video` up to date with its engine events until it ends."""
    try:
        async for event in handle:
            if isinstance(event, ProgressEvent):
                video.status = "in_progress"
                video.progress = min(99, 100 * event.step // event.total_steps)  # 100 once its MP4 is kept
            elif isinstance(event, PartialImageEvent):
                video.previews.append(event.image)
            elif isinstance(event, ImageEvent):
                video.mp4, video.thumbnail = event.image, event.thumbnail
                video.status, video.progress = "completed", 100
                ctx.videos.finish(video)
            elif isinstance(event, ErrorEvent):
                video.status, video.error = "failed", {"code": event.kind, "message": event.message}
                ctx.videos.finish(video)
            video.touch()
    finally:
        ctx.inflight.finish(video.id)
        video.touch()


@router.get("/v1/videos/{video_id}/events")
async def video_events(request: Request, video_id: str, ctx: ApiContext = Depends(get_context)) -> StreamingResponse:
    """Server-Sent Events of a video as it is made (gouache's): `video.in_progress` (the video
    object) when its progress moves, `video.partial_image` (a PNG of its first frame, as many as
    it asked with `partial_images`), then `video.completed` or `video.failed` (the video object),
    and the stream ends. A late client gets the state it missed first."""
    video = _video(ctx, request, video_id)
    return StreamingResponse(_events(video), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def _events(video: Video) -> AsyncIterator[bytes]:
    shown, previews = None, 0
    while True:
        changed = video.changed  # taken before the state is read: no change between is missed
        for index, image in enumerate(video.previews[previews:], previews):
            yield sse("video.partial_image", {"type": "video.partial_image", "id": video.id,
                                              "partial_image_index": index, "output_format": "png",
                                              "b64_json": base64.b64encode(image).decode()})
        previews = len(video.previews)
        if video.finished:
            yield sse(f"video.{video.status}", {"type": f"video.{video.status}", **video.body()})
            return
        if (video.status, video.progress) != shown:
            shown = (video.status, video.progress)
            yield sse("video.in_progress", {"type": "video.in_progress", **video.body()})
        await changed.wait()


@router.get("/v1/videos")
async def list_videos(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=MAX_LIST),
                      order: Literal["asc", "desc"] = "desc",
                      ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    videos, more = ctx.videos.page(tenant_of(request).name, after, limit, order)
    return {"object": "list", "data": [v.body() for v in videos], "first_id": videos[0].id if videos else None,
            "last_id": videos[-1].id if videos else None, "has_more": more}


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return _video(ctx, request, video_id).body()


@router.get("/v1/videos/{video_id}/content")
async def download_video(request: Request, video_id: str, variant: str = "video",
                         ctx: ApiContext = Depends(get_context)) -> Response:
    video = _video(ctx, request, video_id)
    if variant not in MEDIA:
        raise InvalidRequestError(f"Invalid value for 'variant': '{variant}'; gouache serves "
                                  f"{' and '.join(map(repr, MEDIA))}.", "variant")
    if video.status != "completed":
        raise InvalidRequestError(f"Video '{video_id}' is {video.status}: its content can be downloaded once its "
                                  "status is completed.", "video_id")
    return Response(video.mp4 if variant == "video" else video.thumbnail, media_type=MEDIA[variant])


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    video = _video(ctx, request, video_id)
    ctx.inflight.abort(video.id)  # a running one's slot is freed within a step
    ctx.videos.pop(video.id)
    return {"id": video.id, "object": "video.deleted", "deleted": True}


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("The body is not valid JSON: send a JSON object of the video's fields, or a "
                                  "multipart form.") from None
    if not isinstance(fields, dict):
        raise InvalidRequestError("The body must be a JSON object of the video's fields.")
    return fields


async def _form_reference(form: FormData, fields: dict[str, str], ctx: ApiContext) -> bytes | None:
    """A form's `input_reference`: a file, or OpenAI's reference object as the fields
    `input_reference[image_url]` or `input_reference[file_id]` (taken out of `fields`)."""
    if "input_reference" in form:
        return await read_upload(form["input_reference"], "input_reference")
    parts = {key: fields.pop(f"input_reference[{key}]") for key in ("image_url", "file_id")
             if f"input_reference[{key}]" in fields}
    return _reference_object(parts, ctx) if parts else None


def _reference_object(reference: Any, ctx: ApiContext) -> bytes | None:
    """The image of OpenAI's reference object: `{"image_url": a base64 data URL}` or
    `{"file_id": an image this server made for a url response}` (gouache fetches no URLs)."""
    if reference is None:
        return None
    if not isinstance(reference, dict) or len(reference) != 1 or not {"image_url", "file_id"} >= reference.keys():
        raise InvalidRequestError("Invalid value for 'input_reference': send the first frame as a file, or an object "
                                  "of one field, image_url (a base64 data URL) or file_id.", "input_reference")
    [(key, value)] = reference.items()
    if not isinstance(value, str):
        raise InvalidRequestError(f"Invalid value for 'input_reference.{key}': must be a string.", "input_reference")
    if key == "file_id":
        stored = ctx.files.get(value)
        if stored is None:
            raise InvalidRequestError(f"Invalid value for 'input_reference.file_id': no file '{value}' (unknown or "
                                      "expired); file ids are those of this server's url images.", "input_reference")
        return stored.data
    header, _, encoded = value.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise InvalidRequestError("Invalid value for 'input_reference.image_url': gouache fetches no URLs; send a "
                                  "base64 data URL (data:image/png;base64,...) or the image as a file.",
                                  "input_reference")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("Invalid value for 'input_reference.image_url': its data is not valid base64.",
                                  "input_reference") from None


def _check_reference(info: ModelInfo, reference: bytes | None) -> None:
    """An image-to-video model takes a first frame with every clip, a text-to-video one none."""
    if info.clips is None:
        return  # the model makes images: `to_request` says so
    if reference is None and info.clips.from_image:
        raise InvalidRequestError(f"Missing required parameter: 'input_reference': '{info.name}' makes a clip from "
                                  "its first frame; send it (a PNG, JPEG or WebP, resized to the clip's size).",
                                  "input_reference")
    if reference is not None and not info.clips.from_image:
        raise InvalidRequestError(f"Invalid value for 'input_reference': '{info.name}' makes clips from text only "
                                  "(an image-to-video model takes a first frame); leave it out.", "input_reference")


def _video(ctx: ApiContext, request: Request, video_id: str) -> Video:
    """The video `video_id` of the request's tenant (another key's is as unknown as a missing one)."""
    video = ctx.videos.get(video_id)
    if video is None or video.tenant != tenant_of(request).name:
        raise NotFoundError(f"No video '{video_id}': it does not exist, has expired or was deleted.", "video_id")
    return video
