"""The conditioning cache: what a request's preparation computes from its prompt and its upload,
kept for the next request that brings the same ones.

- **text**: the text encoders' outputs of one (prompt, negative prompt, guidance on or off),
  as the pipeline's `encode_prompt` returns them. The encoders are deterministic, so a hit is
  the tensors a fresh call would give, bit for bit; each request builds its own conditioning
  from them (`torch.cat`, size ids), never writing into them.
- **vae**: the VAE's latent distribution of an edit's upload, by a digest of its pixels. A
  request still draws its sample from the distribution with its own generator, as the pipeline
  does, so the result is the same seed for seed.

Both sit in one LRU under a byte budget (`--conditioning-mb`, 0: off). Many production prompts
repeat: templates, retries, n > 1 across requests, edits of one photo. The runner's prepare
stage is the only caller; a lock keeps it safe for more.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from gouache.outputs import ConditioningReport


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in `value`: a tensor, or tuples, lists, dicts and objects holding
    them, however nested."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if hasattr(value, "__dict__"):
        return sum(tensor_bytes(v) for v in vars(value).values())
    return 0


def pixels_digest(pixels: torch.Tensor) -> str:
    """A digest of an image tensor's values, shape and dtype."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tuple(pixels.shape)} {pixels.dtype}".encode())
    digest.update(pixels.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ConditioningCache:
    def __init__(self, budget_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def text(self, key: Hashable, encode: Callable[[], Any]) -> Any:
        """`encode()` (the pipeline's `encode_prompt` for the prompt, negative prompt and guidance
        that `key` names), or what it returned for the same key before."""
        return self._get("text", key, encode)

    def latent_dist(self, pixels: torch.Tensor, encode: Callable[[], Any]) -> Any:
        """`encode()` (the VAE's latent distribution of `pixels`), or the one of the same pixels before."""
        return self._get("vae", pixels_digest(pixels), encode)

    def take_report(self) -> ConditioningReport:
        """Lookups since the last report, and what the cache holds."""
        with self._lock:
            counts, self._counts = self._counts, {}
            return ConditioningReport(counts, self.nbytes)

    def _get(self, kind: str, key: Hashable, encode: Callable[[], Any]) -> Any:
        full = (kind, key)
        with self._lock:
            entry = self._entries.get(full)
            if entry is not None:
                self._entries.move_to_end(full)
            self._count(kind, "hit" if entry is not None else "miss")
        if entry is not None:
            return entry[0]
        value = encode()
        size = tensor_bytes(value)
        if size <= self.budget_bytes:
            with self._lock:
                if full not in self._entries:
                    self._entries[full] = (value, size)
                    self.nbytes += size
                while self.nbytes > self.budget_bytes:
                    _, (_, dropped) = self._entries.popitem(last=False)
                    self.nbytes -= dropped
        return value

    def _count(self, kind: str, result: str) -> None:
        self._counts[(kind, result)] = self._counts.get((kind, result), 0) + 1
