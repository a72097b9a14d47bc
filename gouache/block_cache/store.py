"""PatchedServe §5's block cache: reuse a block's output from an earlier step for the units
(patches, or whole images) whose input to that block barely changed.

A forward's batch is a sequence of *units*, contiguous per image: the patches of each image
under patched batching, or one unit per image (a row of the model's own batch). Before each
cached block, a unit is reused when

    mean |x - x_then| / mean |x_then|  <  its request's threshold

where `x_then` is the unit's input to that block at the step the block last computed it, and
the unit has been reused at most `max_reuse` times in a row (the paper's limit on consecutive
reuse: without it, error accumulates while the input drifts in small steps). The block runs on
the other units only; the reused ones take its cached output.

Cross-unit operators inside a block (a convolution's halo, GroupNorm's image statistics,
self-attention) need every unit of an image, also the reused ones. For those the cache keeps
each operator's input as of the step each unit was last computed (`stale`), as DistriFusion
fills the patches it did not compute with the previous step's activations.

Batched, as the paper's cache manager is: a forward's cached units are the rows of one *store*
per batch composition, one tensor per block input, block output and operator input. While the
composition holds (the common case: step after step of the same running batch), a block costs
a handful of whole-batch tensor operations, whatever the number of units. A new composition
(a request joined or left) builds its store once from the rows its images had elsewhere (the
paper's common set); new images start without history (its new set) and the rows of images
that left are dropped with their store (its expired set).

Requests whose threshold is 0 are not cached at all, so exact stays exact: their units are
computed in every block and nothing of theirs is stored. Memory is bounded: after a forward
that leaves the cache above its byte budget, the most recently cached requests are evicted,
with the stores that hold them, and run uncached to their end.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import torch

from gouache.config import BlockCacheConfig
from gouache.outputs import BlockCacheReport

ImageKey = tuple[str, int]  # (request id, forward row): one image of a forward
Signature = tuple[str, tuple[ImageKey, ...], tuple[int, ...]]  # (mode, cached images, their units)


class _Block:
    """A store's history at one block, a row per cached unit."""

    def __init__(self, inputs: torch.Tensor, outputs: list[torch.Tensor | None], valid: torch.Tensor):
        self.inputs, self.outputs, self.valid = inputs, outputs, valid  # valid: the row has a history
        self.reused = torch.zeros(len(inputs), dtype=torch.long, device=inputs.device)  # steps reused in a row

    def tensors(self) -> list[torch.Tensor]:
        return [self.inputs, *(o for o in self.outputs if o is not None)]


class _Store:
    """The cached rows of one batch composition."""

    def __init__(self, signature: Signature):
        self.signature = signature
        _, self.keys, self.units = signature
        self.offsets = {}
        row = 0
        for key, n in zip(self.keys, self.units):
            self.offsets[key] = slice(row, row + n)
            row += n
        self.blocks: dict[Hashable, _Block] = {}
        self.stale: dict[Hashable, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        blocks = sum(t.nbytes for b in self.blocks.values() for t in b.tensors())
        return blocks + sum(t.nbytes for t in self.stale.values())


class BlockCache:
    """The cached activations of every cached image of one model runner; `pass_type` decides
    each forward's reuse (a benchmark's subclass of `CachePass` may fix it)."""

    def __init__(self, config: BlockCacheConfig | None = None, pass_type: type[CachePass] | None = None):
        self.config = config or BlockCacheConfig()
        self.pass_type = pass_type or CachePass
        self._stores: dict[Signature, _Store] = {}
        self._home: dict[ImageKey, _Store] = {}  # the store holding each cached image's rows
        self._released: set[str] = set()  # filled from other threads, applied at the next forward
        self._refused: set[str] = set()  # evicted for the budget: uncached until released
        self._lock = threading.Lock()
        self.skeletons: dict[Hashable, object] = {}  # per block, the tuple nesting of its output
        self.reused = 0  # unit-blocks taken from the cache
        self.computed = 0  # unit-blocks of cached images computed
        self.evictions = 0  # requests evicted for the budget
        self.nbytes = 0  # held after the last forward
        self.decide_s = 0.0  # seconds a pass spent deciding beyond the threshold's comparison (a predictor's)
        self._reported = (0, 0, 0.0)  # reused, computed, decide_s at the last report

    def take_report(self) -> BlockCacheReport:
        """What the cache did since the last report (once per step), and what it holds."""
        reused, computed, decide_s = self._reported
        self._reported = (self.reused, self.computed, self.decide_s)
        return BlockCacheReport(self.reused - reused, self.computed - computed, self.nbytes, self.decide_s - decide_s)

    def threshold(self, request_id: str, asked: float | None) -> float:
        """The threshold a request runs with: its own, else the server's; 0 once it was evicted."""
        if request_id in self._refused:
            return 0.0
        return self.config.threshold if asked is None else asked

    def begin(self, keys: Sequence[ImageKey], units: Sequence[int], thresholds: Sequence[float], mode: str,
              context: Sequence[tuple[float, float]] | None = None) -> CachePass | None:
        """A forward over images `keys` (in unit order) with `units[i]` units each; None when no
        image of it is cached (the forward then runs as without a cache). `context`: per image,
        (steps done / steps, log2 of its pixels), for passes that decide on more than the input."""
        self._purge()
        cached = [i for i, t in enumerate(thresholds) if t > 0]
        if not cached:
            return None
        signature = (mode, tuple(keys[i] for i in cached), tuple(units[i] for i in cached))
        store = self._stores.get(signature) or self._build(signature)
        return self.pass_type(self, store, units, thresholds, context or [(0.0, 0.0)] * len(keys))

    def release(self, request_id: str) -> None:
        """Forget a request's activations (any thread; applied before the next forward)."""
        with self._lock:
            self._released.add(request_id)

    def settle(self) -> None:
        """Free what released requests held (the engine thread, between steps)."""
        if self._purge():
            self.nbytes = sum(store.nbytes for store in self._stores.values())

    def _purge(self) -> bool:
        with self._lock:
            released, self._released = self._released, set()
        if released:
            self._drop({key for key in self._home if key[0] in released})
            self._refused -= released
        return bool(released)

    def _drop(self, keys: set[ImageKey]) -> None:
        """Forget these images, and every store no image lives in any more."""
        for key in keys:
            self._home.pop(key, None)
        live = {id(store) for store in self._home.values()}
        self._stores = {sig: store for sig, store in self._stores.items() if id(store) in live}

    def _build(self, signature: Signature) -> _Store:
        """A new composition's store, from the rows its images have in their old stores."""
        store = _Store(signature)
        sources = []  # per image: (old store, its rows there) or None
        for key, n in zip(store.keys, store.units):
            old = self._home.get(key)
            same = (old is not None and old.signature[0] == signature[0]
                    and old.offsets[key].stop - old.offsets[key].start == n)
            sources.append((old, old.offsets[key]) if same else None)
        olds = {id(src[0]): src[0] for src in sources if src is not None}.values()
        for name in dict.fromkeys(b for old in olds for b in old.blocks):
            parts = [(src[0].blocks.get(name), src[1]) if src else (None, None) for src in sources]
            like = next(block for block, _ in parts if block is not None)
            store.blocks[name] = _Block(
                _gather([(b and b.inputs, rows) for b, rows in parts], like.inputs, store.units),
                [None if o is None else _gather([(b and b.outputs[k], rows) for b, rows in parts], o, store.units)
                 for k, o in enumerate(like.outputs)],
                torch.cat([torch.full((n,), b is not None, device=like.inputs.device)
                           for (b, _), n in zip(parts, store.units)]),
            )
        for name in dict.fromkeys(op for old in olds for op in old.stale):
            parts = [(src[0].stale.get(name), src[1]) if src else (None, None) for src in sources]
            store.stale[name] = _gather(parts, next(t for t, _ in parts if t is not None), store.units)
        for key in store.keys:
            self._home[key] = store
        self._stores[signature] = store
        self._drop(set())
        return store

    def end(self) -> None:
        """After a forward: count the bytes held; over budget, evict the newest requests first."""
        total = sum(store.nbytes for store in self._stores.values())
        newest = list(dict.fromkeys(key[0] for key in self._home))[::-1]
        for request_id in newest:
            if total <= self.config.budget_bytes:
                break
            self._refused.add(request_id)
            self.evictions += 1
            stores = {id(s) for k, s in self._home.items() if k[0] == request_id}
            self._drop({k for k, s in self._home.items() if id(s) in stores})
            total = sum(store.nbytes for store in self._stores.values())
        self.nbytes = total


def _gather(parts: list[tuple[torch.Tensor | None, slice | None]], like: torch.Tensor,
            units: Sequence[int]) -> torch.Tensor:
    """One store tensor from each image's old rows (zeros for an image without them)."""
    return torch.cat([t[rows] if t is not None else like.new_zeros((n, *like.shape[1:]))
                      for (t, rows), n in zip(parts, units)])


class CachePass:
    """The cache's view of one forward: decides, merges and records per block."""

    caches_kv = False  # operators read their inputs from `stale`

    def __init__(self, cache: BlockCache, store: _Store, units: Sequence[int], thresholds: Sequence[float],
                 context: Sequence[tuple[float, float]]):
        self.cache, self.store = cache, store
        self.num_units = sum(units)
        bounds, start = [], 0
        for n, t, c in zip(units, thresholds, context):
            if t > 0:
                bounds.append((start, n, t, c))
            start += n
        self._bounds = bounds  # (first unit, units, threshold, context) of each cached image
        self._depth: dict[Hashable, int] = {}  # each block's position in the forward, as met
        self.all_cached = len(bounds) == len(units)
        self._reuse: dict[Hashable, torch.Tensor | None] = {}  # this pass's decisions per block
        self._rows: torch.Tensor | None = None  # [store rows] the forward's unit of each
        self._thresholds: torch.Tensor | None = None  # [store rows]

    @property
    def skeletons(self) -> dict[Hashable, object]:
        return self.cache.skeletons

    def select_text(self, block: Hashable, text: torch.Tensor) -> None:
        """Text rows are always computed here (each image's text attends to all of its tokens)."""
        return None

    def merge_text(self, block: Hashable, fresh: torch.Tensor, computed: None) -> torch.Tensor:
        return fresh

    def _setup(self, device: torch.device) -> None:
        """Index tensors on the device of the activations, made at the first block."""
        if self._rows is None or self._rows.device != device:
            self._rows = torch.cat([torch.arange(a, a + n, device=device) for a, n, _, _ in self._bounds])
            self._thresholds = torch.cat([torch.full((n,), t, device=device) for _, n, t, _ in self._bounds])

    def context(self, device: torch.device) -> torch.Tensor:
        """[store rows, 3] (steps done / steps, log2 pixels, part) of each cached unit; part is 0
        for whole images, 1 for patches and tokens."""
        part = float(self.store.signature[0] != "image")
        per_image = torch.tensor([(*c, part) for _, _, _, c in self._bounds], device=device)
        return per_image.repeat_interleave(torch.tensor([n for _, n, _, _ in self._bounds], device=device), dim=0)

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows of the cached units."""
        return x if self.all_cached else x.index_select(0, self._rows)

    def select(self, block: Hashable, x: torch.Tensor) -> torch.Tensor | None:
        """Indices of the units the block must compute, from its input x [units, ...]; None: all."""
        if x.shape[0] != self.num_units:
            raise ValueError(f"block input has {x.shape[0]} rows for {self.num_units} units")
        self._setup(x.device)
        entry = self.store.blocks.get(block)
        self._reuse[block] = None
        self._depth.setdefault(block, len(self._depth))
        if entry is None or entry.inputs.shape[1:] != x.shape[1:]:
            return None
        reuse = entry.valid & self.unchanged(block, entry, x) & (entry.reused < self.cache.config.max_reuse)
        if not bool(reuse.any()):
            return None
        self._reuse[block] = reuse
        keep = torch.ones(self.num_units, dtype=torch.bool, device=x.device)
        keep[self._rows[reuse]] = False
        return keep.nonzero().squeeze(1)

    def unchanged(self, block: Hashable, entry: _Block, x: torch.Tensor) -> torch.Tensor:
        """[store rows] whether each cached unit's input x barely changed since the block last
        computed it (its relative change under its request's threshold)."""
        then = entry.inputs.flatten(1)
        change = (self._cached(x).flatten(1) - then).abs().mean(1) / then.abs().mean(1).clamp_min(1e-12)
        return change < self._thresholds.to(change.dtype)

    def merge(self, block: Hashable, x: torch.Tensor, computed: torch.Tensor | None,
              fresh: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """The block's outputs for every unit: `fresh` (rows of `computed`, or all; None when no
        unit was computed) where computed, the cache's elsewhere; records the computed units'
        input and outputs."""
        entry, reuse = self.store.blocks.get(block), self._reuse.pop(block)
        counts = self.cache
        if reuse is None:  # every unit computed
            cx, outs = self._cached(x), [None if f is None else self._cached(f) for f in fresh]
            if entry is None or entry.inputs.shape != cx.shape:
                self.store.blocks[block] = _Block(cx.clone(), [None if o is None else o.clone() for o in outs],
                                                  torch.ones(len(cx), dtype=torch.bool, device=cx.device))
            else:
                entry.inputs.copy_(cx)
                for mine, o in zip(entry.outputs, outs):
                    if mine is not None:
                        mine.copy_(o)
                entry.reused.zero_()
                entry.valid.fill_(True)
            counts.computed += len(cx)
            return list(fresh)
        like = fresh if fresh is not None else entry.outputs
        full = [None if f is None else f.new_empty((self.num_units, *f.shape[1:])) for f in like]
        if fresh is not None:
            for out, f in zip(full, fresh):
                if out is not None:
                    out[computed] = f
        local = (~reuse).nonzero().squeeze(1)  # store rows computed this time
        units_reused, units_computed = self._rows[reuse], self._rows[local]
        for out, mine in zip(full, entry.outputs):
            if out is not None:
                out[units_reused] = mine[reuse]
                mine[local] = out[units_computed]
        entry.inputs[local] = x[units_computed]
        entry.reused = torch.where(reuse, entry.reused + 1, 0)
        entry.valid.fill_(True)
        n_reused = int(reuse.sum())
        counts.reused += n_reused
        counts.computed += len(reuse) - n_reused
        return full

    def stale(self, op: Hashable, x: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        """An operator's input for every unit: x (rows of `computed`, or all) where computed, its
        input at the step each other unit was last computed elsewhere. Records x."""
        self._setup(x.device)
        held = self.store.stale.get(op)
        if computed is None:
            cx = self._cached(x)
            if held is None or held.shape != cx.shape:
                self.store.stale[op] = cx.clone()
            else:
                held.copy_(cx)
            return x
        if held is None or held.shape[1:] != x.shape[1:]:  # no history: zeros (never read by a reused unit)
            held = self.store.stale[op] = x.new_zeros((len(self._rows), *x.shape[1:]))
        if self.all_cached:  # the store's rows are the forward's: update them in place
            return held.index_copy_(0, computed, x)
        full = x.new_zeros((self.num_units, *x.shape[1:]))
        full[self._rows] = held
        full[computed] = x
        held.copy_(full[self._rows])
        return full

    def end(self) -> None:
        self.cache.end()
