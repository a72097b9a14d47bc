"""Images of `response_format=url` responses: kept in memory for `file_ttl_s`, within a byte
budget, by unguessable id."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoredFile:
    data: bytes  # the encoded image
    media_type: str  # image/png | image/jpeg | image/webp
    expires_at: float  # clock() time after which the file is gone


class FileStore:
    """Bytes by random id, dropped after `ttl_s` or, oldest first, beyond `max_bytes` in total."""

    def __init__(self, ttl_s: float, max_bytes: int = 2 << 30, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._files: OrderedDict[str, StoredFile] = OrderedDict()  # insertion order = expiry order
        self._bytes = 0

    def put(self, data: bytes, media_type: str) -> str:
        self._evict(incoming=len(data))
        file_id = "file-" + secrets.token_urlsafe(18)  # unguessable: the URL is the only secret
        self._files[file_id] = StoredFile(data, media_type, self._clock() + self.ttl_s)
        self._bytes += len(data)
        return file_id

    def get(self, file_id: str) -> StoredFile | None:
        self._evict()
        return self._files.get(file_id)

    def __len__(self) -> int:
        return len(self._files)

    def _evict(self, incoming: int = 0) -> None:
        now = self._clock()
        while self._files:
            oldest = next(iter(self._files.values()))
            if oldest.expires_at > now and self._bytes + incoming <= self.max_bytes:
                return
            self._bytes -= len(self._files.popitem(last=False)[1].data)
