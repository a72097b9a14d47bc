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
a block's weights as inputs): a bucket compiles 3-4 graphs whatever the model's depth.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gouache.attention import QKV
from gouache.runner.buckets import TOKEN_ALIGN, Buckets, Range, choose
from gouache.runner.compiled import CompiledDenoiser, Graph
from gouache.runner.pack_dit import Packing

log = logging.getLogger(__name__)


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


def token_buckets(row_buckets: Sequence[int], image_tokens: Sequence[int], graphs: int) -> Buckets | None:
    """Token buckets for each row bucket of a packed forward (kind `tokens x{rows}`), within
    `graphs` graphs: a step of r rows (above the row bucket below) holds between r and
    r * max tokens. None where the sizes compiled give no mix (fewer than two token counts) or
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
    A family's subclass gives `pieces` (the compiled functions' driver), and `example` and
    `inputs` (a packing and inputs of a bucket's shapes, for the warm-up)."""

    def __init__(self, compiled: CompiledDenoiser, buckets: Buckets):
        self.compiled, self.buckets = compiled, buckets

    def run(self, packing: Packing, inputs: Callable[[TokenLayout], tuple]) -> torch.Tensor | None:
        """The image rows [tokens, ...] of `packing`'s forward, its pieces compiled at its bucket
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

    def pieces(self, layout: TokenLayout, *inputs) -> torch.Tensor:
        """The forward's image rows [tokens, ...] from its padded inputs."""
        raise NotImplementedError

    def example(self, rows: int, tokens: int, text_len: int) -> Packing:
        """A packing of `rows` rows whose image tokens fill at most `tokens`, `text_len` text rows each."""
        raise NotImplementedError

    def inputs(self, layout: TokenLayout) -> tuple:
        """Warm-up inputs of `layout`'s shapes (values do not matter)."""
        raise NotImplementedError

