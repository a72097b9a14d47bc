"""PatchedServe §5's block cache: reuse a block's output from an earlier step for the units
(patches, or whole images) whose input to that block barely changed.

A forward's batch is a sequence of *units*, contiguous per image: the patches of each image
under patched batching, or one unit per image (a row of the model's own batch). Before each
cached block, a unit is reused when

    mean |x - x_then| / mean |x_then|  <  its request's threshold

where `x_then` is the unit's input to that block at the step the block last computed it, and
the unit has been reused at most `max_reuse` times in a row (the paper's limit on consecutive
reuse: without it, error accumulates while the input drifts in small steps). The block runs on
the other units only; the reused ones take its cached output. Decisions, copies and updates
are batched per image: a few tensor operations per block, not one per unit.

Cross-unit operators inside a block (a convolution's halo, GroupNorm's image statistics,
self-attention) need every unit of an image, also the reused ones. For those the cache keeps
each operator's input as of the step each unit was last computed (`stale`), as DistriFusion
fills the patches it did not compute with the previous step's activations.

Requests whose threshold is 0 are not cached at all, so exact stays exact: their units are
computed in every block and nothing of theirs is stored. Memory is bounded: after a forward
that leaves the cache above its byte budget, the most recently cached requests are evicted
and run uncached to their end.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
import torch

from gouache.config import BlockCacheConfig

ImageKey = tuple[str, int]  # (request id, forward row): one image of a forward


class _Entry:
    """One image at one block: per unit, the input and outputs when last computed, and how many
    steps in a row it has been reused since."""

    def __init__(self, inputs: torch.Tensor, outputs: list[torch.Tensor | None]):
        self.inputs = inputs.clone()
        self.outputs = [None if o is None else o.clone() for o in outputs]
        self.reused = torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)

    def fits(self, inputs: torch.Tensor, outputs: Sequence[torch.Tensor | None]) -> bool:
        return self.inputs.shape == inputs.shape and [None if o is None else o.shape for o in self.outputs] == [
            None if o is None else o.shape for o in outputs]

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + sum(o.nbytes for o in self.outputs if o is not None)


class _Image:
    """What the cache holds for one image in one unit layout (`mode`, units)."""

    def __init__(self, mode: str, units: int):
        self.mode, self.units = mode, units
        self.blocks: dict[Hashable, _Entry] = {}
        self.stale: dict[Hashable, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.blocks.values()) + sum(t.nbytes for t in self.stale.values())


class BlockCache:
    """The cached activations of every cached image of one model runner."""

    def __init__(self, config: BlockCacheConfig | None = None):
        self.config = config or BlockCacheConfig()
        self._images: dict[ImageKey, _Image] = {}
        self._released: set[str] = set()  # filled from other threads, applied at the next forward
        self._refused: set[str] = set()  # evicted for the budget: uncached until released
        self._lock = threading.Lock()
        self.skeletons: dict[Hashable, object] = {}  # per block, the tuple nesting of its output
        self.reused = 0  # unit-blocks taken from the cache
        self.computed = 0  # unit-blocks of cached images computed
        self.evictions = 0  # requests evicted for the budget
        self.nbytes = 0  # held after the last forward

    def threshold(self, request_id: str, asked: float | None) -> float:
        """The threshold a request runs with: its own, else the server's; 0 once it was evicted."""
        if request_id in self._refused:
            return 0.0
        return self.config.threshold if asked is None else asked

    def begin(self, keys: Sequence[ImageKey], units: Sequence[int], thresholds: Sequence[float], mode: str) -> CachePass | None:
        """A forward over images `keys` (in unit order) with `units[i]` units each; None when no
        image of it is cached (the forward then runs as without a cache)."""
        self._purge()
        if not any(t > 0 for t in thresholds):
            return None
        images: list[_Image | None] = []
        for key, n, t in zip(keys, units, thresholds):
            if t <= 0:
                images.append(None)
                continue
            image = self._images.get(key)
            if image is None or image.mode != mode or image.units != n:
                image = self._images[key] = _Image(mode, n)
            images.append(image)
        return CachePass(self, images, list(units), list(thresholds))

    def release(self, request_id: str) -> None:
        """Forget a request's activations (any thread; applied before the next forward)."""
        with self._lock:
            self._released.add(request_id)

    def _purge(self) -> None:
        with self._lock:
            released, self._released = self._released, set()
        if released:
            for key in [k for k in self._images if k[0] in released]:
                del self._images[key]
            self._refused -= released

    def end(self) -> None:
        """After a forward: count the bytes held; over budget, evict the newest requests first."""
        sizes = {key: image.nbytes for key, image in self._images.items()}
        total = sum(sizes.values())
        for key in reversed(list(self._images)):
            if total <= self.config.budget_bytes:
                break
            request_id = key[0]
            if request_id in self._refused:
                continue
            self._refused.add(request_id)
            self.evictions += 1
            for k in [k for k in self._images if k[0] == request_id]:
                total -= sizes[k]
                del self._images[k]
        self.nbytes = total


class CachePass:
    """The cache's view of one forward: decides, merges and records per block."""

    def __init__(self, cache: BlockCache, images: list[_Image | None], units: list[int], thresholds: list[float]):
        self.cache, self.images, self.units = cache, images, units
        self.thresholds = thresholds
        bounds = [0]
        for n in units:
            bounds.append(bounds[-1] + n)
        self.segments = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        self.num_units = bounds[-1]
        self._reuse: dict[Hashable, list[torch.Tensor | None]] = {}  # this pass's decisions per block

    def select(self, block: Hashable, x: torch.Tensor) -> torch.Tensor | None:
        """Indices of the units the block must compute, from its input x [units, ...]; None: all."""
        if x.shape[0] != self.num_units:
            raise ValueError(f"block input has {x.shape[0]} rows for {self.num_units} units")
        decisions, any_reuse = [], False
        for image, seg, t in zip(self.images, self.segments, self.thresholds):
            entry = None if image is None else image.blocks.get(block)
            if entry is None or entry.inputs.shape != x[seg].shape:
                decisions.append(None)
                continue
            then = entry.inputs.flatten(1)
            change = (x[seg].flatten(1) - then).abs().mean(1) / then.abs().mean(1).clamp_min(1e-12)
            reuse = (change < t) & (entry.reused < self.cache.config.max_reuse)
            decisions.append(reuse)
            any_reuse = any_reuse or bool(reuse.any())
        self._reuse[block] = decisions
        if not any_reuse:
            return None
        keep = torch.ones(self.num_units, dtype=torch.bool, device=x.device)
        for seg, reuse in zip(self.segments, decisions):
            if reuse is not None:
                keep[seg] = ~reuse
        return keep.nonzero().squeeze(1)

    def merge(self, block: Hashable, x: torch.Tensor, computed: torch.Tensor | None,
              fresh: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """The block's outputs for every unit: `fresh` (rows of `computed`, or all; None when no
        unit was computed) where computed, the cache's elsewhere; records the computed units'
        input and outputs."""
        if computed is None:
            full = list(fresh)
        else:
            # Every unit reused: every image has an entry, whose outputs give the shapes.
            like = fresh if fresh is not None else next(
                image.blocks[block].outputs for image in self.images if image is not None)
            full = [None if f is None else f.new_empty((self.num_units, *f.shape[1:])) for f in like]
            if fresh is not None:
                for out, f in zip(full, fresh):
                    if out is not None:
                        out[computed] = f
        counts = self.cache
        for image, seg, reuse in zip(self.images, self.segments, self._reuse.pop(block)):
            if image is None:
                continue
            outputs = [None if o is None else o[seg] for o in full]
            entry = image.blocks.get(block)
            if entry is None or reuse is None or not entry.fits(x[seg], outputs):
                image.blocks[block] = _Entry(x[seg], outputs)
                counts.computed += len(x[seg])
                continue
            fresh_rows = ~reuse
            for mine, out in zip(entry.outputs, outputs):
                if mine is not None:
                    out[reuse] = mine[reuse]  # `out` is a view of `full`: fills the merged output
                    mine[fresh_rows] = out[fresh_rows]
            entry.inputs[fresh_rows] = x[seg][fresh_rows]
            entry.reused = torch.where(reuse, entry.reused + 1, 0)
            n_reused = int(reuse.sum())
            counts.reused += n_reused
            counts.computed += len(reuse) - n_reused
        return full

    def stale(self, op: Hashable, x: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        """An operator's input for every unit: x (rows of `computed`, or all) where computed, its
        input at the step each other unit was last computed elsewhere. Records x."""
        if computed is None:
            full = x
        else:
            full = x.new_zeros((self.num_units, *x.shape[1:]))
            for image, seg in zip(self.images, self.segments):
                held = None if image is None else image.stale.get(op)
                if held is not None and held.shape[1:] == x.shape[1:]:
                    full[seg] = held
            full[computed] = x
        for image, seg in zip(self.images, self.segments):
            if image is None:
                continue
            held = image.stale.get(op)
            if held is not None and held.shape == full[seg].shape:
                held.copy_(full[seg])
            else:
                image.stale[op] = full[seg].clone()
        return full

    def end(self) -> None:
        self.cache.end()
