"""Packed DiT forwards as compiled pieces (issue 59; docs/speed.md "Techniques in the graph"):
images of mixed sizes in one forward, compiled once per bucket, whatever mix fills it.

The packed forward (`runner/pack_dit.py`) reads its layout in Python: which rows are whose, one
modulation per run of rows, one attention call per image size. Here the layout is data: each
image row and text row carries the forward row (slot) it belongs to as an index tensor, and a
block's modulations are gathered by it, so the per-token work (embeddings, norms, modulations,
projections, feed-forwards) depends on the step's shape only. That shape is padded up to a
bucket: its forward rows to a row bucket (`--compile-buckets`, text rows with them) and its
image tokens to a token bucket (`runner/buckets.py`, chosen per row bucket); padding rows take
slot 0's modulations, attend to nothing and are dropped. Attention over per-image segments is
the break between pieces, run eagerly per image size as in the eager packed forward: on this
CPU it beat a dense segment mask and `flex_attention` by 2-4x (`benchmarks/segment_attention.py`).

So a forward of N blocks runs N + 1 compiled pieces (the embeddings and the first block's
projections; the end of one block and the projections of the next, N - 1 times; the last
block's end and the output), and equal blocks share one graph (dynamo's inlined modules take
a block's weights as inputs): a bucket compiles 3-5 graphs whatever the model's depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from gouache.attention import QKV, project
from gouache.config import COMPILE_GRAPHS, CompileConfig
from gouache.runner.buckets import TOKEN_ALIGN, Buckets, Range, choose
from gouache.runner.compiled import CompiledDenoiser, Graph
from gouache.runner.pack_dit import Packing


@dataclass(frozen=True)
class TokenLayout:
    """A packed forward's layout padded to its bucket: `rows` forward rows (slots) of
    `text_len` text rows each and `tokens` image rows; `image_index` / `text_index`: the slot
    of each image / text row (padding rows: slot 0)."""

    packing: Packing
    rows: int
    tokens: int
    image_index: torch.Tensor  # [tokens]
    text_index: torch.Tensor  # [rows * text_len]

    @classmethod
    def of(cls, packing: Packing, rows: int, tokens: int) -> TokenLayout:
        if rows < len(packing.order) or tokens < packing.image_rows:
            raise ValueError(f"a bucket of {rows} rows and {tokens} tokens cannot hold {len(packing.order)} rows "
                             f"of {packing.image_rows} tokens")
        return cls(packing, rows, tokens, _pad(packing.image_index, tokens),
                   _pad(packing.text_index, rows * packing.text_len))

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """Image rows [S_img, ...] padded with zeros to [tokens, ...]."""
        return _pad(x, self.tokens)

    def text(self, x: torch.Tensor) -> torch.Tensor:
        """Text rows [S_txt, ...] padded with zeros to [rows * text_len, ...]."""
        return _pad(x, self.rows * self.packing.text_len)

    def slots(self, x: torch.Tensor) -> torch.Tensor:
        """Per forward row [n, ...] padded to [rows, ...] with copies of the last (a valid
        timestep or embedding: padding slots compute what a real one does, and are dropped)."""
        return torch.cat([x, x[-1:].expand(self.rows - len(x), *x.shape[1:])]) if self.rows > len(x) else x

    def attend(self, image: QKV, text: QKV, text_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The break between pieces: joint attention of each image over its text and its own
        tokens (the packing's real rows), padded back: ([tokens, H*d], [rows * text_len, H*d])."""
        s, t = self.packing.image_rows, len(self.packing.text_index)
        return self.packing.attend(tuple(x[:s] for x in image), tuple(x[:t] for x in text), text_first,
                                   padding=(self.tokens - s, len(self.text_index) - t))


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - len(x), *x.shape[1:])]) if n > len(x) else x


def budget(compiled: CompiledDenoiser, config: CompileConfig, image_tokens: Sequence[int]) -> Buckets:
    """The token buckets a compiled model's packed pieces get: the graphs `--compile-graphs`
    leaves after a row graph per size and row bucket (none, where the sizes compiled make no
    mix or no graph is left: packed steps then run eagerly, reason `mixed_sizes`)."""
    return token_buckets(compiled.buckets, image_tokens, graphs_left(compiled, config)) or Buckets({})


def graphs_left(compiled: CompiledDenoiser, config: CompileConfig) -> int:
    """The graphs `--compile-graphs` leaves to forwards of mixed sizes (packed pieces, a patched
    UNet's) after a row graph per size and row bucket."""
    row_graphs = len(compiled.buckets) * max(1, len(config.sizes))
    return (COMPILE_GRAPHS if config.graphs is None else config.graphs) - row_graphs


def token_buckets(row_buckets: Sequence[int], image_tokens: Sequence[int], graphs: int) -> Buckets | None:
    """Token buckets for each row bucket of a packed forward (kind `tokens x{rows}`), within
    `graphs` graphs: a step at row bucket r (more rows than the bucket below, b) holds between
    (b + 1) * min and r * max tokens. None where the sizes compiled give no mix (fewer than two token counts) or
    the budget cannot give each row bucket one."""
    if len(set(image_tokens)) < 2:
        return None
    lo, hi = min(image_tokens), max(image_tokens)
    ranges, below = [], 1  # a packed forward has two rows at least
    for rows in sorted(row_buckets):
        if rows > below:
            ranges.append(Range(f"tokens x{rows}", (below + 1) * lo, rows * hi, TOKEN_ALIGN))
        below = rows
    if not ranges or graphs < len(ranges):
        return None
    return choose(ranges, graphs)


class PackedPieces:
    """A family's packed forward as compiled pieces, run through its `CompiledDenoiser` (which
    says whether the step may run compiled, counts it, and runs it eagerly where a graph fails).
    A family's subclass gives its model's `first`, `between` and `last` piece functions (the
    carry between them: image rows x, text rows c, the slots' temb, and what a block's end
    takes from its start besides attention: Flux's single-stream MLP, else None), `rows` (the
    layout's per-row tensors every piece takes) and, for the warm-up, `example` and `inputs`."""

    text_first = False  # the model's joint token order: Flux puts text first, SD3 last

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], compiled: CompiledDenoiser, buckets: Buckets,
                 first: Callable, between: Callable, last: Callable):
        self.model, self.blocks, self.compiled, self.buckets = model, list(blocks), compiled, buckets
        self._first, self._between, self._last = map(compiled.compile, (first, between, last))

    def pieces(self, layout: TokenLayout, *inputs) -> torch.Tensor:
        """The forward's output rows [tokens, ...] from its padded inputs: N + 1 compiled pieces
        around N attention breaks."""
        rows = self.rows(layout)
        x, c, temb, image, text, carry = self._first(self.model, self.blocks[0], *inputs, *rows)
        for done, block in pairwise(self.blocks):
            attended = layout.attend(image, text, self.text_first)
            x, c, image, text, carry = self._between(done, block, x, c, temb, *attended, carry, *rows)
        return self._last(self.model, self.blocks[-1], x, c, temb, *layout.attend(image, text, self.text_first),
                          carry, *rows)

    def rows(self, layout: TokenLayout) -> tuple[torch.Tensor, ...]:
        """The layout's per-row tensors every piece takes: each row's slot, and what else the
        model reads per row (Flux: its RoPE)."""
        return layout.image_index, layout.text_index

    def run(self, packing: Packing, inputs: Callable[[TokenLayout], tuple]) -> torch.Tensor | None:
        """The output rows [tokens, ...] of `packing`'s forward, its pieces compiled at its bucket
        (`inputs` gives their padded inputs from the layout); None where the step runs eagerly
        (counted, with why: its techniques, past the largest bucket of rows or tokens, a graph
        that failed)."""
        rows = self.compiled.bucket(len(packing.order))
        if rows is None:
            return self.compiled.run(None, lambda: None, past="rows")
        tokens = self.buckets.bucket(f"tokens x{rows}", packing.image_rows)
        if tokens is None:
            return self.compiled.run(None, lambda: None, past="tokens")
        layout = TokenLayout.of(packing, rows, tokens)
        return self.compiled.run(Graph(self.key((rows, tokens)), lambda: self.pieces(layout, *inputs(layout)),
                                       self.describe((rows, tokens))), lambda: None)

    def graphs(self, text_len: int) -> list[Graph]:
        """Every bucket's pieces, to compile at warm-up, for prompts of `text_len` rows (one
        example packing each: a bucket's graphs do not depend on which mix fills it)."""
        out = []
        for kind, tokens in self.buckets.by_kind.items():
            rows = int(kind.split("x")[1])
            for t in tokens:
                layout = TokenLayout.of(self.example(rows, t, text_len), rows, t)
                out.append(Graph(self.key((rows, t)), lambda layout=layout: self.pieces(layout, *self.inputs(layout)),
                                 self.describe((rows, t))))
        return out

    def key(self, bucket: tuple[int, int]) -> tuple:
        return ("packed", *bucket)

    @staticmethod
    def describe(bucket: tuple[int, int]) -> str:
        return f"packed {bucket[0]} rows, {bucket[1]} tokens"

    def example(self, rows: int, tokens: int, text_len: int) -> Packing:
        """A packing of `rows` rows whose image tokens fill at most `tokens`, `text_len` text rows each."""
        raise NotImplementedError

    def inputs(self, layout: TokenLayout) -> tuple:
        """Warm-up inputs of `layout`'s shapes (values do not matter)."""
        raise NotImplementedError


# -- what the pieces of MMDiT joint blocks (SD3's, Flux's double-stream) share ------------------

def zero(norm: nn.Module, temb: torch.Tensor, chunks: int = 6) -> tuple[torch.Tensor, ...]:
    """An AdaLayerNormZero's (or its single-stream kind's) modulations per slot [rows, D]."""
    return norm.linear(norm.silu(temb)).chunk(chunks, dim=1)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [R, D] * (1 + scale) + shift, each row its slot's (`index`)."""
    return x * (1 + scale)[index] + shift[index]


def continuous(norm: nn.Module, x: torch.Tensor, temb: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An AdaLayerNormContinuous over rows, its modulation gathered by `index`."""
    scale, shift = norm.linear(norm.silu(temb).to(x.dtype)).chunk(2, dim=1)
    return modulate(norm.norm(x), scale, shift, index)


def joint_qkv(block: nn.Module, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor, image_index: torch.Tensor,
              text_index: torch.Tensor) -> tuple[QKV, QKV]:
    """A joint block's attention inputs: its image and text rows' q, k, v [rows, H, d]."""
    attn = block.attn
    shift, scale = zero(block.norm1, temb)[:2]
    x = modulate(block.norm1.norm(x), scale, shift, image_index)
    if getattr(block, "context_pre_only", False):
        c = continuous(block.norm1_context, c, temb, text_index)
    else:
        c_shift, c_scale = zero(block.norm1_context, temb)[:2]
        c = modulate(block.norm1_context.norm(c), c_scale, c_shift, text_index)
    image = project(x, attn.heads, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
    text = project(c, attn.heads, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                   (attn.norm_added_q, attn.norm_added_k))
    return image, text


def joint_finish(block: nn.Module, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor, image_out: torch.Tensor,
                 text_out: torch.Tensor, image_index: torch.Tensor, text_index: torch.Tensor):
    """A joint block's rows after its attention: (x, c), c None after a block that keeps no text
    (SD3's last)."""
    attn = block.attn
    _, _, gate, shift_mlp, scale_mlp, gate_mlp = zero(block.norm1, temb)
    x = x + gate[image_index] * attn.to_out[1](attn.to_out[0](image_out))
    ff = block.ff(modulate(block.norm2(x), scale_mlp, shift_mlp, image_index))
    x = x + gate_mlp[image_index] * ff
    if getattr(block, "context_pre_only", False):
        return x, None
    _, _, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = zero(block.norm1_context, temb)
    c = c + c_gate[text_index] * attn.to_add_out(text_out)
    ff = block.ff_context(modulate(block.norm2_context(c), c_scale_mlp, c_shift_mlp, text_index))
    return x, c + c_gate_mlp[text_index] * ff
