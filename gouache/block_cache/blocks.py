"""The block cache (`gouache.block_cache.store`) on an unmodified diffusers denoiser.

For one forward, every cached block (a UNet's down, mid and up blocks; each transformer block
of a DiT) is replaced by a `CachedBlock` wrapper. It asks the cache which units to compute,
runs the block on those units' rows only, and merges the cached outputs of the others back in.
The units (`Mode`):

- `image`: the rows of the model's own batch, one per image (any policy, any family);
- `patch`: the patches of a patched UNet forward (PatchedServe's patch-level reuse, inside a
  mixed-size batch); the patch operators (`patch_ops`) fill the rows of reused patches from the
  cache's stale activations (`PatchIndex.subset`);
- `token`: the image tokens of a packed DiT forward (mixed sizes; a token is 2x2 latent pixels).
  Text rows are always computed (each image's text attends to all of its tokens), so the block
  always runs; attention takes the reused tokens' keys and values from the stale activations
  (`Packing.subset`), and the norms, feed-forwards and output projections run on the computed
  tokens only;
- `token_rows`: the tokens of a packed Wan forward (clips of mixed shapes), whose rows carry
  their clip's modulations and whose text is no row (cross-attention per clip): a block whose
  every token is reused does not run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gouache.block_cache.store import BlockCache, CachePass, ImageKey


@dataclass(frozen=True)
class Mode:
    """How a block runs on some of its units."""

    per_unit: tuple[str, ...]  # block arguments with one row per unit: sliced to the computed units
    unit_outputs: tuple[int, ...] | None  # which of the block's outputs have a row per unit; None: all
    always_runs: bool  # the block runs even when every unit is reused (it has other rows to compute)
    text: str | None = None  # the argument with one row per text token (packed DiTs), which a pass may subset
    text_output: int | None = None  # ... and the output that has them


MODES = {
    "image": Mode(("hidden_states", "temb", "res_hidden_states_tuple", "encoder_hidden_states"), None, False),
    # the text stays per image: the patch operators index it
    "patch": Mode(("hidden_states", "temb", "res_hidden_states_tuple"), None, False),
    # DiT blocks return (text rows, image rows); temb is per image, modulations follow `Packing`
    "token": Mode(("hidden_states",), (1,), True, "encoder_hidden_states", 0),
    # Wan's packed blocks: the rows are tokens, each with its clip's modulations (temb per token);
    # the text enters by cross-attention, per clip, and is no row
    "token_rows": Mode(("hidden_states", "temb"), None, False),
}


@dataclass(frozen=True)
class CachedForward:
    """The images of one forward as the cache sees them, in the caller's row order."""

    cache: BlockCache
    keys: tuple[ImageKey, ...]
    thresholds: tuple[float, ...]
    context: tuple[tuple[float, float], ...] = ()  # per row: (steps done / steps, log2 of its image's pixels)

    @classmethod
    def of(cls, states: Sequence, cache: BlockCache | None) -> CachedForward | None:
        """The rows of a forward over denoising `states` (each with its `request` and `rows`) as
        the cache sees them; None when none of them is cached."""
        if cache is None:
            return None
        keys, thresholds, context = [], [], []
        for s in states:
            threshold = cache.threshold(s.request.request_id, s.request.block_cache)
            keys.extend((s.request.request_id, row) for row in range(s.rows))
            thresholds.extend([threshold] * s.rows)
            context.extend([(s.step / len(s.timesteps), math.log2(s.request.width * s.request.height))] * s.rows)
        return cls(cache, tuple(keys), tuple(thresholds), tuple(context)) if any(thresholds) else None

    def begin(self, units: Sequence[int] | None = None, order: Sequence[int] | None = None,
              mode: str = "image", text_len: int = 0) -> CachePass | None:
        """The cache pass of a forward whose units come in image `order` (caller indices),
        `units[i]` for the i-th of them; image mode: one unit per row, in caller order. Text
        rows (`text_len` per image) are always computed here."""
        order = range(len(self.keys)) if order is None else order
        units = [1] * len(order) if units is None else units
        return self.cache.begin([self.keys[i] for i in order], units, [self.thresholds[i] for i in order], mode,
                                [self.context[i] for i in order] if self.context else None)


def cacheable_blocks(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, key) of each block the cache wraps, in forward order; the key names
    the block for the cache, whatever module stands in its slot."""
    slots = []
    for name in ("down_blocks", "transformer_blocks", "single_transformer_blocks", "blocks"):  # blocks: Wan's
        blocks = getattr(model, name, None)
        if blocks is not None:
            slots.extend((blocks, str(i), f"{name}.{i}") for i in range(len(blocks)))
        if name == "down_blocks" and getattr(model, "mid_block", None) is not None:
            slots.append((model, "mid_block", "mid_block"))
    if getattr(model, "up_blocks", None) is not None:
        slots.extend((model.up_blocks, str(i), f"up_blocks.{i}") for i in range(len(model.up_blocks)))
    return slots


class CachedBlock(nn.Module):
    """A block that computes only the units the cache says changed; `run(block, key, per_unit,
    arguments)` runs it on them (`gouache.runner.compiled`: compiled, a piece of the forward),
    else it is called."""

    def __init__(self, inner: nn.Module, key: str, cache_pass: CachePass, mode: Mode, index=None,
                 run: Callable | None = None):
        super().__init__()
        self.inner, self.key, self.cache_pass, self.mode, self.index = inner, key, cache_pass, mode, index
        self.run = run
        self.signature = _signature(type(inner))

    def __getattr__(self, name: str):  # the model reads its blocks' attributes (has_cross_attention, resnets)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        x = bound.arguments["hidden_states"]
        computed = self.cache_pass.select(self.key, x)
        if computed is not None:
            for name in self.mode.per_unit:
                value = bound.arguments.get(name)
                if value is not None:
                    bound.arguments[name] = _rows(value, computed)
        text = None
        if self.mode.text is not None:
            text = self.cache_pass.select_text(self.key, bound.arguments[self.mode.text])
            if text is not None:
                bound.arguments[self.mode.text] = bound.arguments[self.mode.text].index_select(0, text)
        skeletons = self.cache_pass.skeletons
        if computed is not None and not len(computed) and not self.mode.always_runs:  # every unit reused
            return _unflatten(skeletons[self.key], self.cache_pass.merge(self.key, x, computed, None))
        with self._subset(computed, text):
            if self.run is None:
                out = self.inner(*bound.args, **bound.kwargs)
            else:
                out = self.run(self.inner, self.key, self.mode.per_unit, bound.arguments)
        skeletons[self.key] = _skeleton(out)
        leaves = _flatten(out)
        picked = range(len(leaves)) if self.mode.unit_outputs is None else self.mode.unit_outputs
        for i, merged in zip(picked, self.cache_pass.merge(self.key, x, computed, [leaves[i] for i in picked])):
            leaves[i] = merged
        if self.mode.text is not None and leaves[self.mode.text_output] is not None:  # SD3's last block has none
            leaves[self.mode.text_output] = self.cache_pass.merge_text(self.key, leaves[self.mode.text_output], text)
        return _unflatten(out, leaves)

    @contextlib.contextmanager
    def _subset(self, computed: torch.Tensor | None, text: torch.Tensor | None) -> Iterator[None]:
        if self.index is None:
            yield
            return
        self.index.subset = Subset(self.cache_pass, computed, text)
        try:
            yield
        finally:
            self.index.subset = None


@dataclass(frozen=True)
class Subset:
    """What the operators inside a cached block need: the pass and the units it computes."""

    cache_pass: CachePass
    computed: torch.Tensor | None  # indices of the forward's units (patches, tokens); None: all
    text: torch.Tensor | None = None  # indices of the text rows computed (packed DiTs); None: all

    @property
    def caches_kv(self) -> bool:
        """Whether the pass holds attentions' keys and values (`kv`) rather than their inputs (`full`)."""
        return self.cache_pass.caches_kv

    def full(self, op: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """op's input for every unit (stale where not computed)."""
        return self.cache_pass.stale(op, x, self.computed)

    def kv(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention's keys and values for every token, from those of the computed ones."""
        return self.cache_pass.kv(attn, k, v, self.computed)

    def text_kv(self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """... for every text row, from those of the computed ones."""
        return self.cache_pass.text_kv(attn, k, v, self.text)

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.computed is None else full.index_select(0, self.computed)


@functools.cache
def _signature(block_type: type) -> inspect.Signature:
    """A block class's forward signature: wrappers are made per forward, signatures once."""
    unbound = inspect.signature(block_type.forward)
    return unbound.replace(parameters=list(unbound.parameters.values())[1:])  # without self


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
def cached_blocks(model: nn.Module, cache_pass: CachePass | None, mode: str = "image", index=None,
                  run: Callable | None = None) -> Iterator[None]:
    """Wrap `model`'s blocks for one forward of `cache_pass`, whose units are of `mode`; `index`
    (a `PatchIndex` or a `Packing`) tells its operators which units a block computes; `run`: how
    a block runs on them (`CachedBlock`). Restore the blocks and settle the cache's memory on
    exit. No pass: the model as it is."""
    if cache_pass is None:
        yield
        return
    slots = cacheable_blocks(model)
    originals = [getattr(parent, name) for parent, name, _ in slots]
    try:
        for (parent, name, key), block in zip(slots, originals):
            setattr(parent, name, CachedBlock(block, key, cache_pass, MODES[mode], index, run))
        yield
    finally:
        for (parent, name, _), block in zip(slots, originals):
            setattr(parent, name, block)
        cache_pass.end()
