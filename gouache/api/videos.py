"""OpenAI's videos API: POST /v1/videos makes a clip in the background and answers at once with
a video object (`queued`); GET /v1/videos/{id} says its status and progress, GET /v1/videos lists
them (paged), GET /v1/videos/{id}/content downloads the MP4 (or `variant=thumbnail`, its first
frame as WebP), DELETE /v1/videos/{id} cancels a running one (its slot freed within a step) and
forgets it. Finished clips are kept for `--file-ttl-s` within a byte budget, oldest dropped
first, as `url` images are.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.datastructures import FormData

from gouache.api.context import ApiContext, get_context
from gouache.api.errors import NotFoundError
from gouache.api.images import check_model, require_content_type, submit, tenant_of, text_fields
from gouache.api.protocol import VideoCreateRequest
from gouache.errors import InvalidRequestError
from gouache.outputs import ErrorEvent, ImageEvent, ProgressEvent

if TYPE_CHECKING:
    from gouache.engine.handle import RequestHandle

router = APIRouter()

MAX_LIST = 100  # videos one page of GET /v1/videos lists at most
_MAX_FORM_FIELDS = 64
MEDIA = {"video": "video/mp4", "thumbnail": "image/webp"}


@dataclass
class Video:
    """One clip of the videos API, from its request to its expiry."""

    id: str
    model: str
    prompt: str
    size: str  # WIDTHxHEIGHT
    num_frames: int
    fps: int
    seed: int
    created_at: int  # unix seconds
    status: str = "queued"  # queued | in_progress | completed | failed
    progress: int = 0  # percent of its denoising steps done
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None  # {code, message} of a failed one
    mp4: bytes = b""
    thumbnail: bytes = b""
    follower: asyncio.Task | None = field(default=None, repr=False)  # consumes its engine events

    @property
    def nbytes(self) -> int:
        return len(self.mp4) + len(self.thumbnail)

    def body(self) -> dict[str, Any]:
        """OpenAI's Video object, and gouache's fields (`num_frames`, `fps`, `seed`)."""
        seconds = f"{(self.num_frames - 1) / self.fps:g}"
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": self.prompt, "seconds": seconds, "size": self.size,
                "error": self.error, "remixed_from_video_id": None,
                "num_frames": self.num_frames, "fps": self.fps, "seed": self.seed}


class VideoStore:
    """Videos by id in creation order. A finished one (completed or failed) is dropped `ttl_s`
    after it finished, or, oldest first, while the clips kept exceed `max_bytes`."""

    def __init__(self, ttl_s: float, max_bytes: int = 2 << 30, clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._videos: OrderedDict[str, Video] = OrderedDict()

    def add(self, video: Video) -> None:
        self._videos[video.id] = video

    def finish(self, video: Video) -> None:
        """`video` completed or failed now: it expires `ttl_s` from now."""
        now = self._clock()
        video.completed_at, video.expires_at = int(now), int(now + self.ttl_s)
        self._evict()

    def get(self, video_id: str) -> Video | None:
        self._evict()
        return self._videos.get(video_id)

    def pop(self, video_id: str) -> Video | None:
        return self._videos.pop(video_id, None)

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[Video], bool]:
        """Up to `limit` videos after the one named `after` in `order` ("asc": oldest first), and
        whether more follow."""
        self._evict()
        videos = list(self._videos.values())
        if order == "desc":
            videos.reverse()
        if after is not None:
            ids = [v.id for v in videos]
            if after not in ids:
                raise NotFoundError(f"No video '{after}' to list after: it does not exist or has expired.", "after")
            videos = videos[ids.index(after) + 1:]
        return videos[:limit], len(videos) > limit

    def _evict(self) -> None:
        now = self._clock()
        finished = [v for v in self._videos.values() if v.expires_at is not None]
        kept = sum(v.nbytes for v in finished)
        for video in finished:  # in creation order: the oldest first
            if video.expires_at > now and kept <= self.max_bytes:
                continue
            kept -= video.nbytes
            del self._videos[video.id]


@router.post("/v1/videos")
async def create_video(request: Request, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    arrival = time.monotonic()
    video_id = request.state.request_id = "video_" + secrets.token_hex(12)
    require_content_type(request, "multipart/form-data", also=("application/json",))
    if request.headers.get("content-type", "").startswith("application/json"):
        fields, strict = _json_object(await request.body()), True
    else:  # OpenAI's client: a form, every field text
        form = await request.form(max_files=1, max_fields=_MAX_FORM_FIELDS)
        fields, strict = {**text_fields(form, files=("input_reference",)), **_reference(form)}, False
    if "input_reference" in fields:
        raise InvalidRequestError(f"Invalid value for 'input_reference': '{ctx.engine.info.name}' makes clips from "
                                  "text only (image-to-video is not served); leave it out.", "input_reference")
    params = VideoCreateRequest.model_validate(fields, strict=strict, context=ctx.validation_context)
    check_model(ctx, params)
    tenant = tenant_of(request)
    job = params.to_request(video_id, ctx.engine.info, arrival, tenant)
    handle = await submit(ctx, tenant, [job])
    ctx.inflight.add(video_id, handle, lambda: ctx.tenants.release(tenant))
    video = Video(video_id, ctx.model_ids[0], params.prompt, f"{job.width}x{job.height}", job.num_frames, job.fps,
                  job.seed, created_at=int(time.time()))
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
            elif isinstance(event, ImageEvent):
                video.mp4, video.thumbnail = event.image, event.thumbnail
                video.status, video.progress = "completed", 100
                ctx.videos.finish(video)
            elif isinstance(event, ErrorEvent):
                video.status, video.error = "failed", {"code": event.kind, "message": event.message}
                ctx.videos.finish(video)
    finally:
        ctx.inflight.finish(video.id)


@router.get("/v1/videos")
async def list_videos(after: str | None = None, limit: int = Query(20, ge=1, le=MAX_LIST),
                      order: Literal["asc", "desc"] = "desc",
                      ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    videos, more = ctx.videos.page(after, limit, order)
    return {"object": "list", "data": [v.body() for v in videos], "first_id": videos[0].id if videos else None,
            "last_id": videos[-1].id if videos else None, "has_more": more}


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return _video(ctx, video_id).body()


@router.get("/v1/videos/{video_id}/content")
async def download_video(video_id: str, variant: str = "video", ctx: ApiContext = Depends(get_context)) -> Response:
    video = _video(ctx, video_id)
    if variant not in MEDIA:
        raise InvalidRequestError(f"Invalid value for 'variant': '{variant}'; gouache serves "
                                  f"{' and '.join(map(repr, MEDIA))}.", "variant")
    if video.status != "completed":
        raise InvalidRequestError(f"Video '{video_id}' is {video.status}: its content can be downloaded once its "
                                  "status is completed.", "video_id")
    return Response(video.mp4 if variant == "video" else video.thumbnail, media_type=MEDIA[variant])


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    video = _video(ctx, video_id)
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


def _reference(form: FormData) -> dict[str, Any]:
    """A form's `input_reference`, a file or text, if it sent one."""
    return {"input_reference": True} if "input_reference" in form else {}


def _video(ctx: ApiContext, video_id: str) -> Video:
    video = ctx.videos.get(video_id)
    if video is None:
        raise NotFoundError(f"No video '{video_id}': it does not exist, has expired or was deleted.", "video_id")
    return video
