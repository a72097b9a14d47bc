"""Clips of the videos API (`gouache.api.videos`) from their request to their expiry: kept in
memory by id, a finished one for `ttl_s` within a byte budget, oldest dropped first."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gouache.api.errors import NotFoundError


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
    tenant: str  # whose API key made it: only that key sees it ("" on a server without keys)
    created_at: int  # unix seconds
    status: str = "queued"  # queued | in_progress | completed | failed
    progress: int = 0  # percent of its denoising steps done
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, str] | None = None  # {code, message} of a failed one
    mp4: bytes = b""
    thumbnail: bytes = b""
    previews: list[bytes] = field(default_factory=list, repr=False)  # PNGs of its first frame as it denoises
    follower: asyncio.Task | None = field(default=None, repr=False)  # consumes its engine events
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set, then replaced, at each change

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed")

    def touch(self) -> None:
        """Wake whoever waits on `changed` (an event stream): something of it changed."""
        self.changed.set()
        self.changed = asyncio.Event()

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

    def page(self, tenant: str, after: str | None, limit: int, order: str) -> tuple[list[Video], bool]:
        """Up to `limit` of `tenant`'s videos after the one named `after` in `order` ("asc": oldest
        first), and whether more follow."""
        self._evict()
        videos = [v for v in self._videos.values() if v.tenant == tenant]
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
