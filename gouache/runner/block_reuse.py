"""The block cache (`gouache.cache.block_cache`) on an unmodified diffusers denoiser.

For one forward, every cached block (a UNet's down, mid and up blocks; each transformer block
of a DiT) is replaced by a `CachedBlock` wrapper. It asks the cache which units to compute,
runs the block on those units' rows only, and merges the cached outputs of the others back in.
Units are the rows of the model's own batch (`image` mode: one per image, any policy) or the
patches of a patched UNet forward (`patch` mode: PatchedServe's patch-level reuse, inside a
mixed-size batch). In patch mode the patch operators (`patch_ops`) fill the rows of reused
patches from the cache's stale activations (`PatchIndex.subset`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gouache.cache.block_cache import BlockCache, CachePass, ImageKey

# Block arguments with one row per unit: sliced to the computed units. In patch mode the
# text stays per image (the patch operators index it), in image mode it is per row too.
PER_UNIT = ("hidden_states", "temb", "res_hidden_states_tuple")
PER_UNIT_IMAGE = (*PER_UNIT, "encoder_hidden_states")


@dataclass(frozen=True)
class CacheRequest:
    """The images of one forward as the cache sees them, in the caller's row order."""

    cache: BlockCache
    keys: tuple[ImageKey, ...]
    thresholds: tuple[float, ...]

    def begin(self, units: Sequence[int] | None = None, order: Sequence[int] | None = None,
              mode: str = "image") -> CachePass | None:
        """The cache pass of a forward whose units come in image `order` (caller indices),
        `units[i]` for the i-th of them; image mode: one unit per row, in caller order."""
        order = range(len(self.keys)) if order is None else order
        units = [1] * len(self.keys) if units is None else units
        return self.cache.begin([self.keys[i] for i in order], units, [self.thresholds[i] for i in order], mode)


def cacheable_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each block the cache wraps, in forward order."""
    slots = []
    for name in ("down_blocks", "transformer_blocks", "single_transformer_blocks"):
        blocks = getattr(model, name, None)
        if blocks is not None:
            slots.extend((blocks, str(i)) for i in range(len(blocks)))
        if name == "down_blocks" and getattr(model, "mid_block", None) is not None:
            slots.append((model, "mid_block"))
    if getattr(model, "up_blocks", None) is not None:
        slots.extend((model.up_blocks, str(i)) for i in range(len(model.up_blocks)))
    return slots


class CachedBlock(nn.Module):
    """A block that computes only the units the cache says changed."""

    def __init__(self, inner: nn.Module, cache_pass: CachePass, per_unit: tuple[str, ...], index=None):
        super().__init__()
        self.inner, self.cache_pass, self.per_unit, self.index = inner, cache_pass, per_unit, index
        self.signature = inspect.signature(inner.forward)

    def __getattr__(self, name: str):  # the model reads its blocks' attributes (has_cross_attention, resnets)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        x = bound.arguments["hidden_states"]
        computed = self.cache_pass.select(self.inner, x)
        if computed is not None:
            for name in self.per_unit:
                value = bound.arguments.get(name)
                if value is not None:
                    bound.arguments[name] = _rows(value, computed)
        skeletons = self.cache_pass.cache.skeletons
        if computed is not None and not len(computed):  # every unit reused: the block does not run
            return _unflatten(skeletons[self.inner], self.cache_pass.merge(self.inner, x, computed, None))
        with self._subset(computed):
            out = self.inner(*bound.args, **bound.kwargs)
        skeletons[self.inner] = _skeleton(out)
        return _unflatten(out, self.cache_pass.merge(self.inner, x, computed, _flatten(out)))

    @contextlib.contextmanager
    def _subset(self, computed: torch.Tensor | None) -> Iterator[None]:
        if self.index is None:
            yield
            return
        self.index.subset = Subset(self.cache_pass, computed)
        try:
            yield
        finally:
            self.index.subset = None


@dataclass(frozen=True)
class Subset:
    """What the patch operators of a cached block need: the pass and the computed patches."""

    cache_pass: CachePass
    computed: torch.Tensor | None  # indices into the layout's patches; None: all

    def full(self, op: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """op's input for every patch (stale where not computed)."""
        return self.cache_pass.stale(op, x, self.computed)

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.computed is None else full.index_select(0, self.computed)


def _rows(value, index: torch.Tensor):
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index)
    return type(value)(_rows(v, index) for v in value)


def _flatten(out) -> list[torch.Tensor | None]:
    if isinstance(out, tuple):
        return [leaf for part in out for leaf in _flatten(part)]
    return [out]


def _skeleton(out):
    """The tuple nesting of a block's output, without its tensors."""
    return tuple(_skeleton(part) for part in out) if isinstance(out, tuple) else None


def _unflatten(like, leaves: list[torch.Tensor | None]):
    """`leaves` in the nesting of `like` (a tensor, None or nested tuples of them)."""
    it = iter(leaves)

    def build(node):
        return tuple(build(part) for part in node) if isinstance(node, tuple) else next(it)

    return build(like)


@contextlib.contextmanager
def cached_blocks(model: nn.Module, cache_pass: CachePass | None, index=None) -> Iterator[None]:
    """Wrap `model`'s blocks for one forward of `cache_pass` (patch mode when a `PatchIndex` is
    given); restore them and settle the cache's memory on exit. No pass: the model as it is."""
    if cache_pass is None:
        yield
        return
    per_unit = PER_UNIT if index is not None else PER_UNIT_IMAGE
    slots = cacheable_blocks(model)
    originals = [getattr(parent, name) for parent, name in slots]
    try:
        for (parent, name), block in zip(slots, originals):
            setattr(parent, name, CachedBlock(block, cache_pass, per_unit, index))
        yield
    finally:
        for (parent, name), block in zip(slots, originals):
            setattr(parent, name, block)
        cache_pass.end()
