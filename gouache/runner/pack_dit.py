"""Packed inference for DiTs (SD3's MMDiT, Flux): images of different sizes in ONE forward,
every token computed once.

The model runs unchanged on a batch whose rows are tokens: image tokens as `[S_img, 1, D]`
(image-major, raster order inside an image, images of one size adjacent) and text tokens as
`[S_txt, 1, D]` (each image's own text once, in the same image order). Every per-token layer
(linears, norms, FFNs, gating) is then right as it is. Three things see more than one row, and
are put right from the outside for the duration of the forward:

- conditioning: every AdaLN modulation and gate is computed once per image from the image's
  `temb` and applied per run of rows (`Packing.runs`: the images of one size are one run, viewed
  as their own batch), so no per-row copy of a modulation is made and every elementwise op reads
  what it reads in the model's own batch (SD3: `PackedJointBlock`, `PackedContinuousNorm`; Flux,
  whose blocks are still the model's: `ExpandRows` hands each row its image's modulation);
- position: SD3's patch embedding adds each token's slice of its image's cropped sincos
  embedding; Flux's RoPE is made per size from each image's own ids;
- joint attention: each image attends over [its text + its image tokens] (same-size images
  together, one attention call per size), in the model's token order.

This module has the packing and what the models share; SD3's pieces are in `pack_sd3`, Flux's
in `pack_flux`. No text copy per patch and no halo: the work is that of the images alone, plus
the gathers. Images all of one size need no packing: they run as the model's own batch (unless
`whole_batches` is False: benchmarks timing the packing itself).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from torch import nn

from gouache.attention import QKV, attend_each, attention_modules, project
from gouache.block_cache.blocks import CachedForward


@dataclass(frozen=True)
class Group:
    """Images of one token layout, adjacent in the packing."""

    shape: tuple[int, ...]  # token layout (`Packing.shapes`)
    count: int
    image_rows: slice
    text_rows: slice

    @property
    def tokens(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Run:
    """Rows of images with as many rows each, adjacent: `images` are their packed positions."""

    rows: slice
    images: slice


def per_image(x: torch.Tensor, runs: Sequence[Run], factor: torch.Tensor,
              shift: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, 1, D] rows times their image's `factor` (plus its `shift`), both [num_images, D] in
    packed order: an AdaLN modulation or gate, each run's rows viewed as a batch of its images
    (the same elementwise ops, in the same order, as on the model's own batch)."""
    out = torch.empty_like(x)
    for run in runs:
        count = run.images.stop - run.images.start
        rows = out[run.rows].view(count, -1, x.shape[-1])
        torch.mul(x[run.rows].reshape(count, -1, x.shape[-1]), factor[run.images, None], out=rows)
        if shift is not None:
            rows.add_(shift[run.images, None])
    return out


@dataclass
class Packing:
    """Where each image's tokens and text go among the rows. `order` lists caller indices in
    packed order (by size, then caller order)."""

    # token layout per caller index: a grid (h, w) in raster order, or (n, h, w): n grids of one
    # size in turn (FLUX.1 Kontext: the image's own tokens, then its reference's)
    shapes: tuple[tuple[int, ...], ...]
    text_len: int
    order: tuple[int, ...]
    groups: tuple[Group, ...]
    image_index: torch.Tensor  # [S_img] caller index of each image row
    text_index: torch.Tensor  # [S_txt] caller index of each text row
    positions: torch.Tensor  # [num_images] caller index of each packed position (`order`)
    # Inside a block the block cache computes some image rows only (`block_cache.blocks.Subset`):
    # blocks then get those rows, and attention takes the others' from the cache.
    subset: object = field(default=None, compare=False)

    @classmethod
    def build(cls, shapes: Sequence[tuple[int, ...]], text_len: int, device: torch.device) -> Packing:
        order = tuple(sorted(range(len(shapes)), key=lambda i: (shapes[i], i)))
        groups, image_row, text_row = [], 0, 0
        for shape in dict.fromkeys(shapes[i] for i in order):
            count = sum(1 for s in shapes if s == shape)
            tokens = math.prod(shape)
            groups.append(Group(shape, count, slice(image_row, image_row + count * tokens),
                                slice(text_row, text_row + count * text_len)))
            image_row, text_row = image_row + count * tokens, text_row + count * text_len
        caller = torch.tensor(order, device=device)
        tokens = torch.tensor([math.prod(shapes[i]) for i in order], device=device)
        return cls(tuple(shapes), text_len, order, tuple(groups), caller.repeat_interleave(tokens),
                   caller.repeat_interleave(text_len), caller)

    @property
    def image_rows(self) -> int:
        return len(self.image_index)

    def runs(self, text: bool = False) -> list[Run]:
        """The runs of the rows a block gets, image rows or text rows: one per size, or under a
        subset one per image with any row computed."""
        chosen = None if self.subset is None else (self.subset.text if text else self.subset.computed)
        if chosen is None:
            if text:
                return [Run(slice(0, len(self.text_index)), slice(0, len(self.order)))]
            firsts = list(itertools.accumulate((g.count for g in self.groups), initial=0))
            return [Run(g.image_rows, slice(a, a + g.count)) for g, a in zip(self.groups, firsts)]
        cuts = row_cuts(chosen, self.bounds(text))
        return [Run(slice(a, b), slice(j, j + 1)) for j, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]

    def bounds(self, text: bool) -> list[int]:
        """Where each image's text or image rows start among all of them, in packed order, and
        where the last ones end."""
        if text:
            return [j * self.text_len for j in range(len(self.order) + 1)]
        return [*(g.image_rows.start + n * g.tokens for g in self.groups for n in range(g.count)), self.image_rows]

    def pack(self, per_image: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per caller index [tokens, ...] -> [S_img, ...] in packed order."""
        return torch.cat([per_image[i] for i in self.order])

    def unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """[S_img, ...] -> per caller index [tokens, ...]."""
        sizes = [math.prod(self.shapes[i]) for i in self.order]
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for i, part in zip(self.order, rows.split(sizes)):
            out[i] = part
        return out

    def text(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_images, L, D] in caller order -> [S_txt, 1, D] rows."""
        order = torch.tensor(self.order, device=encoder_hidden_states.device)
        return encoder_hidden_states[order].flatten(0, 1)[:, None]

    def attend(self, image: QKV, text: QKV | None, text_first: bool, rope: list | None = None,
               padding: tuple[int, int] = (0, 0)):
        """Joint attention per image. image: [S_img, H, d] each (under a subset, q of the computed
        rows only); text: [S_txt, H, d] each or None -> ([S_img or computed rows, H*d],
        [S_txt, H*d] or None), each followed by its `padding` rows of zeros (a bucket's)."""
        computed = None if self.subset is None else self.subset.computed
        if computed is not None:
            image_out, text_out = self._attend_queries(image, text, text_first, rope, computed)
            if any(padding):
                image_out, text_out = (torch.cat([x, x.new_zeros(n, x.shape[1])]) if x is not None else None
                                       for x, n in zip((image_out, text_out), padding))
            return image_out, text_out
        image_out, text_out = [], []  # one part per size (and padding); a single part is used as it is
        for g, group in enumerate(self.groups):
            qkv = [x[group.image_rows].unflatten(0, (group.count, -1)) for x in image]
            if text is not None:  # in the model's own token order: Flux puts text first, SD3 last
                own = [t[group.text_rows].unflatten(0, (group.count, -1)) for t in text]
                qkv = [torch.cat([t, x] if text_first else [x, t], dim=1) for t, x in zip(own, qkv)]
            if rope is not None:
                qkv[:2] = [apply_rotary_emb(x, rope[g], sequence_dim=1) for x in qkv[:2]]
            out = dispatch_attention_fn(*qkv).flatten(2)  # [count, S, H * d]
            text_part, image_part = self._split(out, text is not None, text_first)
            image_out.append(image_part.flatten(0, 1))
            text_out.append(text_part.flatten(0, 1))
        for parts, rows in zip((image_out, text_out), padding):
            if rows:
                parts.append(parts[0].new_zeros(rows, parts[0].shape[1]))
        joined = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in (image_out, text_out)]
        return joined[0], (joined[1] if text is not None else None)

    def _attend_queries(self, image: QKV, text: QKV | None, text_first: bool, rope: list | None,
                        computed: torch.Tensor):
        """Attention of the computed rows' queries (image tokens, and text rows: all, or under
        template reuse those of the images that compute their text) over every key, per image:
        each has its own number of queries (InstGenIE §3.1); images of equal shapes share a call."""
        q, k, v = image
        bounds = self.bounds(text=False)
        starts, cuts = bounds[:-1], row_cuts(computed, bounds)
        text_computed = self.subset.text
        text_cuts = None
        if text is not None and text_computed is not None:
            text_cuts = row_cuts(text_computed, self.bounds(text=True))
        calls, queried_text, j = [], [], 0
        for g, group in enumerate(self.groups):
            for n in range(group.count):
                start, a, b = starts[j], cuts[j], cuts[j + 1]
                qi, ki, vi = q[a:b], k[start:start + group.tokens], v[start:start + group.tokens]
                queried = 0  # text rows among the queries
                if text is not None:
                    t = group.text_rows.start + n * self.text_len
                    ta, tb = (t, t + self.text_len) if text_cuts is None else (text_cuts[j], text_cuts[j + 1])
                    queried = tb - ta
                    own = (text[0][ta:tb], text[1][t:t + self.text_len], text[2][t:t + self.text_len])
                    qi, ki, vi = [torch.cat([o, x] if text_first else [x, o]) for o, x in zip(own, (qi, ki, vi))]
                j += 1
                if not len(qi):  # every token reused, and no text row (Wan's): nothing to attend
                    continue
                if rope is not None:  # Flux: text first; the queries' positions are their tokens'
                    positions = torch.cat([torch.arange(queried, device=q.device),
                                           self.text_len + computed[a:b] - start])
                    qi = apply_rotary_emb(qi[None], tuple(f[positions] for f in rope[g]), sequence_dim=1)[0]
                    ki = apply_rotary_emb(ki[None], rope[g], sequence_dim=1)[0]
                calls.append((qi, ki, vi))
                queried_text.append(queried)
        image_out, text_out = [q.new_empty(0, q.shape[1] * v.shape[2])], [q.new_empty(0, q.shape[1] * v.shape[2])]
        for out, queried in zip(attend_each(calls), queried_text):
            parts = (queried, len(out) - queried) if text_first else (len(out) - queried, queried)
            first, second = out.split(parts)
            image_out.append(second if text_first else first)
            text_out.append(first if text_first else second)
        return torch.cat(image_out), (torch.cat(text_out) if text is not None else None)

    def _split(self, out: torch.Tensor, has_text: bool, text_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[count, S, D] attention output -> its (text, image) parts along S."""
        sizes = [self.text_len if has_text else 0, out.shape[1] - (self.text_len if has_text else 0)]
        text_part, image_part = out.split(sizes, 1) if text_first else out.split(sizes[::-1], 1)[::-1]
        return text_part, image_part

    @property
    def text_rows_computed(self) -> int:
        """Text rows the blocks get: all, or under template reuse those of the images computing theirs."""
        text = None if self.subset is None else self.subset.text
        return len(self.text_index) if text is None else len(text)


def row_cuts(rows: torch.Tensor, bounds: list[int]) -> list[int]:
    """Where each range [bounds[i], bounds[i + 1]) starts among the sorted `rows` (and the last ends)."""
    return torch.searchsorted(rows, torch.tensor(bounds, device=rows.device)).tolist()


class ExpandRows(nn.Module):
    """Stands in for an AdaLN norm's `linear`: the modulation of each image, computed once from
    its `temb` row, given to each of its rows. With a `packing`, the first `text_rows` of `index`
    are text rows and the rest image rows: under a subset, only the computed ones of each."""

    def __init__(self, linear: nn.Module, index: torch.Tensor, packing: Packing | None = None, text_rows: int = 0):
        super().__init__()
        self.linear, self.index, self.packing, self.text_rows = linear, index, packing, text_rows

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        index = self.index
        subset = None if self.packing is None else self.packing.subset
        if subset is not None:
            text, image = index[:self.text_rows], index[self.text_rows:]
            if subset.text is not None and len(text):
                text = text.index_select(0, subset.text)
            if subset.computed is not None and len(image):
                image = image.index_select(0, subset.computed)
            index = torch.cat([text, image])
        return self.linear(emb).index_select(0, index)


@contextlib.contextmanager
def swapped(transformer: nn.Module, processor, expected: type,
            swaps: list[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Set `processor` on every attention and swap (owner, name, module) in; put all back after."""
    attentions = attention_modules(transformer)
    saved = [attn.processor for _, attn in attentions]
    for (name, _), original in zip(attentions, saved):
        # any other processor (IP-Adapter, fused qkv, PAG) does work this one would silently drop
        if type(original) is not expected:
            raise ValueError(f"packed inference supports {expected.__name__} only; {name} is {type(original).__name__}")
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    try:
        for _, attn in attentions:
            attn.set_processor(processor)
        for owner, name, module in swaps:
            setattr(owner, name, module)
        yield
    finally:
        for owner, name, module in originals:
            setattr(owner, name, module)
        for (_, attn), original in zip(attentions, saved):
            attn.set_processor(original)


def norm_swaps(norm: nn.Module, index: torch.Tensor, packing: Packing | None = None,
               text_rows: int = 0) -> tuple[nn.Module, str, nn.Module]:
    if getattr(norm, "emb", None) is not None or not hasattr(norm, "linear"):
        raise ValueError(f"packed inference expects AdaLN norms modulated from temb; got {type(norm).__name__}")
    return norm, "linear", ExpandRows(norm.linear, index, packing, text_rows)


def image_qkv(packing: Packing, attn: nn.Module, rows: torch.Tensor, projections, norms,
              text_rows: torch.Tensor | None = None) -> QKV:
    """q, k, v [S, H, d] of an attention's image `rows` (after `text_rows`, if given: Flux's
    single-stream blocks). Under a subset, `rows` are the computed tokens': q is theirs only,
    while k and v are of every token, the others' from the cache: the cache's keys and values
    (template reuse, which also subsets `text_rows`), or its inputs to project (the block cache)."""
    subset = packing.subset
    joined = rows if text_rows is None else torch.cat([text_rows, rows])
    if subset is None:
        return tuple(x[0] for x in project(joined.transpose(0, 1), attn.heads, projections, norms))
    split = 0 if text_rows is None else len(text_rows)
    if subset.caches_kv:
        q, k, v = (x[0] for x in project(joined.transpose(0, 1), attn.heads, projections, norms))
        image_k, image_v = subset.kv(attn, k[split:], v[split:])
        if text_rows is None:
            return q, image_k, image_v
        text_k, text_v = subset.text_kv(attn, k[:split], v[:split])
        return q, torch.cat([text_k, image_k]), torch.cat([text_v, image_v])
    every = subset.full(attn, rows)
    if text_rows is not None:
        every = torch.cat([text_rows, every])
    q = project(joined.transpose(0, 1), attn.heads, projections[:1], norms[:1])[0][0]
    k, v = (x[0] for x in project(every.transpose(0, 1), attn.heads, projections[1:], norms[1:]))
    return q, k, v


def text_qkv(packing: Packing, attn: nn.Module, rows: torch.Tensor) -> QKV:
    """q, k, v [S, H, d] of a joint attention's text `rows`: under template reuse the computed
    ones', with keys and values of every text row, the others' from the template."""
    added = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    q, k, v = (x[0] for x in project(rows.transpose(0, 1), attn.heads, added, (attn.norm_added_q, attn.norm_added_k)))
    if packing.subset is not None and packing.subset.caches_kv:
        k, v = packing.subset.text_kv(attn, k, v)
    return q, k, v


def token_pass(cache: CachedForward | None, packing: Packing):
    """The block cache's pass over a packing's image tokens, if any image is cached."""
    return cache and cache.begin([math.prod(packing.shapes[i]) for i in packing.order], packing.order,
                                 "token", packing.text_len)
