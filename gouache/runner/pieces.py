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

Template replays (InstGenIE, `gouache.templates.replay`) run in the same pieces where every
block of the step computes the same rows (no edit records, the load plan runs no block in
full): the pieces take the computed image tokens and text rows only, padded to a `replay
x{rows}` bucket (their slots, positions and RoPE gathered by the computed indices); the break
fills each attention's keys and values of the other rows from the templates and attends the
computed queries per image; the last piece fills the last block's output of the other tokens
from the templates and runs the output norm and projection over every token, padded to the row
bucket's largest replay bucket (so a graph depends on its row and computed-token buckets only).

Ulysses steps (`gouache.parallel.ulysses`) run in them too: each rank's shard of every row's
image tokens and text is a part of the layout as a replay's computed rows are (`Shard`), the
breaks are the group's all-to-alls around attention, and the output rows are gathered after the
last piece; a shard's graphs depend on its row bucket and shard shape only, compiled at warm-up
without the group (`Rehearsal`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from diffusers.models.embeddings import apply_rotary_emb
from torch import nn

from gouache.attention import QKV, project
from gouache.block_cache.blocks import Subset, cacheable_blocks
from gouache.config import COMPILE_GRAPHS, CompileConfig
from gouache.parallel.ulysses import Rehearsal, SequenceShards
from gouache.runner.buckets import TOKEN_ALIGN, Buckets, Range, choose
from gouache.runner.compiled import CompiledDenoiser, Graph
from gouache.runner.pack_dit import Packing, token_pass
from gouache.templates.replay import ReplayForward, TemplatePass


@dataclass(frozen=True)
class Replay:
    """A step's template replays as the pieces run them: every block computes the packing's
    image tokens `computed` and text rows `text` (None: all) and takes the other rows' keys and
    values, and after the last block their outputs, from the templates (`template`, the
    forward's `TemplatePass`); the output piece runs over `full` tokens (a bucket)."""

    template: TemplatePass
    computed: torch.Tensor  # [computed] packed image rows, sorted
    text: torch.Tensor | None  # [computed text rows] packed text rows, sorted; None: all
    full: int
    # where the pieces rotate keys (Flux's RoPE), the (cos, sin) of every image row and text row:
    # the templates keep keys unrotated, as the eager forward rotates after filling them
    rotation: tuple[torch.Tensor, ...] | None = None

    def attend(self, packing: Packing, attn: nn.Module, image: QKV, text: QKV, text_first: bool,
               padding: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The computed rows' attention over every row of their image, the others' keys and
        values the templates'."""
        name = self.template.names[id(attn)]
        rotation = self.rotation or (None,) * 4
        (q, k, v), (tq, tk, tv) = image, text
        image = (q, self._fill(packing, f"{name}.k", k, rotation[:2]), self._fill(packing, f"{name}.v", v))
        text = (tq, self._fill(packing, f"{name}.text_k", tk, rotation[2:], True),
                self._fill(packing, f"{name}.text_v", tv, text=True))
        packing.subset = Subset(self.template, self.computed, self.text)
        try:
            return packing.attend(image, text, text_first, padding=padding)
        finally:
            packing.subset = None

    def _fill(self, packing: Packing, name: str, x: torch.Tensor, rotation: tuple = (None, None),
              text: bool = False) -> torch.Tensor:
        """x of the computed rows (image tokens or text rows) for every row of `packing`, the
        others' from the templates (rotated by `rotation`'s rows, where given)."""
        computed = self.text if text else self.computed
        if computed is None:
            return x
        replayed, rows = self.template.template(name, x, text)
        if rotation[0] is not None and len(replayed):
            cos, sin = (r.index_select(0, replayed) for r in rotation)
            rows = apply_rotary_emb(rows[None], (cos, sin), sequence_dim=1)[0]
        every = len(packing.text_index) if text else packing.image_rows
        full = x.new_zeros(every, *x.shape[1:]).index_copy_(0, computed, x)
        return full.index_copy_(0, replayed, rows) if len(replayed) else full

    def outputs(self, block: str, x: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the output piece: the last block's output rows of every token [full + 1, D], the
        templates' where the pieces compute none (the computed ones' zeros, the extra row where
        padding rows go), and where each of the `tokens` computed rows goes [tokens]."""
        replayed, rows = self.template.template(block, x)  # the eager forward's rows are [tokens, 1, D]
        full = x.new_zeros(self.full + 1, x.shape[1]).index_copy_(0, replayed, rows.reshape(len(rows), x.shape[1]))
        scatter = torch.cat([self.computed, self.computed.new_full((tokens - len(self.computed),), self.full)])
        return full, scatter


class _Blank:
    """A warm-up's stand-in for a replay's templates (`TemplatePass`): no rows to fill."""

    names = collections.defaultdict(str)

    @staticmethod
    def template(name: str, like: torch.Tensor, text: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(0, dtype=torch.long, device=like.device), like[:0]


@dataclass(frozen=True)
class Shard:
    """A Ulysses step's rows on this rank (`gouache.parallel.ulysses`): every forward row's
    contiguous shard of its image tokens and of its text (`computed`, `text`: their packed
    rows; images of one size), attended over every rank's rows through the group's all-to-alls
    (the break between pieces: `SequenceShards.attend`), the output rows gathered from every
    rank after the last piece. The pieces' shapes are a shard's: their graphs take no
    collective."""

    shards: SequenceShards
    computed: torch.Tensor  # [rows * tokens / degree] packed image rows of this rank, sorted
    text: torch.Tensor  # [rows * text_len] packed text rows of this rank, sorted
    text_len: int  # this rank's text rows of each forward row

    @classmethod
    def of(cls, packing: Packing, shards: SequenceShards) -> Shard:
        if len(packing.groups) != 1:
            raise ValueError("a Ulysses step runs images of one size")
        tokens, device = packing.groups[0].tokens, packing.image_index.device
        (start, n), (text_start, length) = shards.image_span(tokens), shards.text_span(packing.text_len)
        rows = torch.arange(len(packing.order), device=device)[:, None]
        computed = rows * tokens + start + torch.arange(n, device=device)
        text = rows * packing.text_len + text_start + torch.arange(length, device=device)
        return cls(shards, computed.flatten(), text.flatten(), length)

    def attend(self, packing: Packing, attn: nn.Module, image: QKV, text: QKV, text_first: bool,
               padding: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows' attention over every rank's (a block that keeps no text, SD3's
        last, exchanges none back: its text rows' output is zeros, unread)."""
        rows = len(packing.order)
        image_out, text_out = self.shards.attend(tuple(x.unflatten(0, (rows, -1)) for x in image),
                                                 tuple(x.unflatten(0, (rows, -1)) for x in text), text_first,
                                                 keep_text=not getattr(attn, "context_pre_only", False))
        image_out = image_out.flatten(0, 1)
        text_out = image_out.new_zeros(len(text[0]), image_out.shape[1]) if text_out is None else text_out.flatten(0, 1)
        return _pad(image_out, len(image_out) + padding[0]), _pad(text_out, len(text_out) + padding[1])

    def gather(self, out: torch.Tensor, rows: int) -> torch.Tensor:
        """Every rank's output rows [rows * tokens, ...], in packed order, from this rank's (the
        first `computed` of `out`)."""
        return self.shards.gather(out[:len(self.computed)].unflatten(0, (rows, -1)), dim=1).flatten(0, 1)


@dataclass(frozen=True)
class TokenLayout:
    """A packed forward's layout padded to its bucket: `rows` forward rows (slots), the text
    rows of `texts` of them (`text_len` each; all, but under a replay) and `tokens` image rows;
    `image_index` / `text_index`: the slot of each image / text row (padding rows: slot 0).
    Under a `part` (a template `Replay`, a Ulysses `Shard`), the rows are its own only."""

    packing: Packing
    rows: int
    tokens: int
    image_index: torch.Tensor  # [tokens]
    text_index: torch.Tensor  # [texts * text_len]
    part: Replay | Shard | None = None

    @classmethod
    def of(cls, packing: Packing, rows: int, tokens: int, part: Replay | Shard | None = None,
           texts: int | None = None) -> TokenLayout:
        image, text = packing.image_index, packing.text_index
        if part is not None:
            image = image.index_select(0, part.computed)
            text = text if part.text is None else text.index_select(0, part.text)
        texts = rows if texts is None else texts
        text_len = part.text_len if isinstance(part, Shard) else packing.text_len
        if rows < len(packing.order) or tokens < len(image) or texts * text_len < len(text):
            raise ValueError(f"a bucket of {rows} rows ({texts} with text) and {tokens} tokens cannot hold "
                             f"{len(packing.order)} rows of {len(image)} tokens and {len(text)} text rows")
        return cls(packing, rows, tokens, _pad(image, tokens), _pad(text, texts * text_len), part)

    @property
    def image_rows(self) -> int:
        """The image rows the pieces compute (the rest pad)."""
        return self.packing.image_rows if self.part is None else len(self.part.computed)

    @property
    def text_rows(self) -> int:
        return len(self.packing.text_index if self.part is None or self.part.text is None else self.part.text)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        """Image rows [S_img, ...] (the part's, under one) padded with zeros to [tokens, ...]."""
        return _pad(x if self.part is None else x.index_select(0, self.part.computed), self.tokens)

    def text(self, x: torch.Tensor) -> torch.Tensor:
        """Text rows [S_txt, ...] (the part's, under one) padded with zeros to the layout's."""
        if self.part is not None and self.part.text is not None:
            x = x.index_select(0, self.part.text)
        return _pad(x, len(self.text_index))

    def slots(self, x: torch.Tensor) -> torch.Tensor:
        """Per forward row [n, ...] padded to [rows, ...] with copies of the last (a valid
        timestep or embedding: padding slots compute what a real one does, and are dropped)."""
        return torch.cat([x, x[-1:].expand(self.rows - len(x), *x.shape[1:])]) if self.rows > len(x) else x

    def attend(self, attn: nn.Module, image: QKV, text: QKV, text_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The break between pieces: joint attention of each image over its text and its own
        tokens (the real rows), padded back: ([tokens, H*d], [rows * text_len, H*d])."""
        s, t = self.image_rows, self.text_rows
        image, text = tuple(x[:s] for x in image), tuple(x[:t] for x in text)
        padding = (self.tokens - s, len(self.text_index) - t)
        if self.part is not None:
            return self.part.attend(self.packing, attn, image, text, text_first, padding)
        return self.packing.attend(image, text, text_first, padding=padding)


def text_slots(rows: int, texts: int, share: int) -> int:
    """The rows whose text a replay's pieces compute, padded: one in `share` of the row bucket's
    `rows` where `texts` fit, else all (so a CFG edit whose unconditional text replays computes
    half the text rows, not all: shapes-dit's 256 px edit ran 576 text rows for 288 computed)."""
    return max(1, rows // share) if texts <= rows // share else rows


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - len(x), *x.shape[1:])]) if n > len(x) else x


def budget(compiled: CompiledDenoiser, config: CompileConfig, image_tokens: Sequence[int],
           replays: bool = False, request_rows: int = 1) -> Buckets:
    """The token buckets a compiled model's packed pieces get (and its template replays', with
    `replays`): the graphs `--compile-graphs` leaves after a row graph per size and row bucket
    (none, where the sizes compiled make no mix or no graph is left: packed steps then run
    eagerly, reason `mixed_sizes`). `request_rows`: a request's rows (2 with CFG)."""
    return token_buckets(compiled.buckets, image_tokens, graphs_left(compiled, config), replays,
                         request_rows) or Buckets({})


def graphs_left(compiled: CompiledDenoiser, config: CompileConfig) -> int:
    """The graphs `--compile-graphs` leaves to forwards of mixed sizes (packed pieces, a patched
    UNet's) after a row graph per size and row bucket."""
    row_graphs = len(compiled.buckets) * max(1, len(config.sizes))
    return (COMPILE_GRAPHS if config.graphs is None else config.graphs) - row_graphs


# A template replay's smallest token bucket holds this share of its row bucket's tokens (1/16). From
# 64 tokens up, three buckets of sd3-arch's 1024 px replays (8,192 tokens over two rows) were 256,
# 768 and 8,192: masks of 0.1-0.5 (800-4,050 computed) all padded to the full forward (H200). From
# 512 they are 1,024, 2,048 and 8,192; four add 4,160. Smaller edits pad up to the sixteenth.
REPLAY_FLOOR = 16


def token_buckets(row_buckets: Sequence[int], image_tokens: Sequence[int], graphs: int,
                  replays: bool = False, request_rows: int = 1) -> Buckets | None:
    """Token buckets for each row bucket of a packed forward (kind `tokens x{rows}`), within
    `graphs` graphs: a step at row bucket r (more rows than the bucket below, b) packs requests
    of `request_rows` rows each (2 with CFG) of the compiled sizes, two sizes at least (one size
    runs its row graph), so its token counts are known (`mixes`) and the buckets go on them (a
    request of other rows or size pads into the bucket that holds it, or runs eagerly past the
    largest); with `replays`, a template replay's too (kind `replay x{rows}`: its computed
    tokens, from a sixteenth of the whole forward's, r * max, up to all of them), where the
    budget gives each kind one after the packed forwards'. None where the sizes compiled give
    neither (no mix and no replays) or the budget cannot give each kind one."""
    if not image_tokens:
        return None
    hi = max(image_tokens)
    packed, replayed, below = [], [], 1  # a packed forward has two rows at least
    for rows in sorted(row_buckets):
        counts = mixes(image_tokens, below // request_rows + 1, rows // request_rows)
        if counts:
            packed.append(Range.of_steps(f"tokens x{rows}", [request_rows * count for count in counts], TOKEN_ALIGN))
        if replays:  # buckets spread from a sixteenth of the tokens up: a series from one token crowds below it
            floor = max(TOKEN_ALIGN, rows * hi // REPLAY_FLOOR)
            replayed.append(Range(f"replay x{rows}", min(floor, rows * hi), rows * hi, TOKEN_ALIGN))
        below = rows
    ranges = packed + replayed if graphs >= len(packed) + len(replayed) else packed
    if not ranges or graphs < len(ranges):
        return None
    return choose(ranges, graphs)


def mixes(image_tokens: Sequence[int], least: int, most: int) -> set[int]:
    """The token counts of `least` to `most` images of the sizes `image_tokens` (tokens each),
    two sizes among them at least."""
    sizes = sorted(set(image_tokens))
    states = {(t, t) for t in sizes}  # (tokens so far, the one size so far; 0 once two sizes)
    out: set[int] = set()
    for n in range(2, most + 1):
        states = {(total + t, one if one == t else 0) for total, one in states for t in sizes}
        if n >= least:
            out |= {total for total, one in states if one == 0}
    return out


class PackedPieces:
    """A family's packed forward as compiled pieces, run through its `CompiledDenoiser` (which
    says whether the step may run compiled, counts it, and runs it eagerly where a graph fails).
    A family's subclass gives its model's `first`, `between` and `last` piece functions (the
    carry between them: image rows x, text rows c, the slots' temb, and what a block's end
    takes from its start besides attention: Flux's single-stream MLP, else None), `rows` (the
    layout's per-row tensors every piece takes) and, for the warm-up, `example` and `inputs`."""

    text_first = False  # the model's joint token order: Flux puts text first, SD3 last
    joined = False  # whether some blocks run text and image rows as one stream (Flux's single-stream, text first)
    # a replay's pieces compute the text of one in `text_share` of its row bucket's rows where
    # its text fits (warmed up so), else of all (compiled when first met): where prompts differ
    # from the recorder's, all rows' without CFG; with CFG the conditional half's, the
    # unconditional rows' text replaying
    text_share = 1

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], compiled: CompiledDenoiser, buckets: Buckets,
                 first: Callable, between: Callable, finish: Callable):
        """`finish(model, block, x, c, temb, image_out, text_out, carry, *rows)`: the last
        block's image rows after its attention."""
        self.model, self.blocks, self.compiled, self.buckets = model, list(blocks), compiled, buckets
        self.keys = [key for _, _, key in cacheable_blocks(model)]  # the blocks' names in templates
        self._first, self._between = map(compiled.compile, (first, between))
        self._last = compiled.compile(functools.partial(last, finish))
        self._replayed = compiled.compile(functools.partial(replayed_last, finish))
        # text rows the last block outputs in each block (SD3's last keeps none), as templates count them
        self._text_blocks = len(self.blocks) - bool(getattr(self.blocks[-1], "context_pre_only", False))

    def pieces(self, layout: TokenLayout, *inputs, owners: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The forward's output rows [tokens, ...] from its padded inputs (under a replay: every
        token's, [its full bucket, ...]): N + 1 compiled pieces around N attention breaks; with
        `owners` (`owners`), the step's segmented adapters bound by them."""
        if owners is not None:
            with self.compiled.slots.tokens(owners):
                return self.pieces(layout, *inputs)
        rows = self.rows(layout)
        x, c, temb, image, text, carry = self._first(self.model, self.blocks[0], *inputs, *rows)
        for done, block in pairwise(self.blocks):
            attended = layout.attend(done.attn, image, text, self.text_first)
            x, c, image, text, carry = self._between(done, block, x, c, temb, *attended, carry, *rows)
        attended = layout.attend(self.blocks[-1].attn, image, text, self.text_first)
        if not isinstance(layout.part, Replay):
            return self._last(self.model, self.blocks[-1], x, c, temb, *attended, carry, *rows)
        full, scatter = layout.part.outputs(self.keys[-1], x, layout.tokens)
        index = _pad(layout.packing.image_index, layout.part.full)
        return self._replayed(self.model, self.blocks[-1], x, c, temb, *attended, carry, full, scatter, index, *rows)

    def rows(self, layout: TokenLayout) -> tuple[torch.Tensor, ...]:
        """The layout's per-row tensors every piece takes: each row's slot, and what else the
        model reads per row (Flux: its RoPE)."""
        return layout.image_index, layout.text_index

    def owners(self, layout: TokenLayout) -> dict[int, torch.Tensor] | None:
        """For segmented adapters (`RowSlots.tokens`): the forward row of each index of every
        leading size the pieces' modules take (slots, image rows, text rows, both joined where
        blocks run them as one stream, a replay's output rows); None where two kinds of rows of
        one size differ (a module could not tell them apart: the step runs eagerly)."""
        slots = torch.arange(layout.rows, device=layout.image_index.device).clamp(max=len(layout.packing.order) - 1)
        kinds = [slots, layout.image_index, layout.text_index]
        if self.joined:
            kinds.append(torch.cat([layout.text_index, layout.image_index]))
        if isinstance(layout.part, Replay):
            kinds.append(_pad(layout.packing.image_index, layout.part.full))
        out: dict[int, torch.Tensor] = {}
        for owner in kinds:
            if not torch.equal(out.setdefault(len(owner), owner), owner):
                return None
        return out

    def _run(self, key: tuple, layout: TokenLayout, inputs: Callable[[TokenLayout], tuple]) -> torch.Tensor | None:
        """The pieces of `layout` run compiled as graph `key` where the step allows it (its
        segmented adapters bound by the layout), else None (counted)."""
        slots, owners = self.compiled.slots, None
        if slots is not None and slots.active and not slots.uniform:
            owners = self.owners(layout)
            if owners is None:
                return self.compiled.run(None, lambda: None, past="segmented adapters")
        return self.compiled.run(Graph(key, lambda: self.pieces(layout, *inputs(layout), owners=owners),
                                       self.describe(key)), lambda: None)

    def rotation(self, packing: Packing) -> tuple[torch.Tensor, ...] | None:
        """Where the pieces rotate queries and keys (RoPE), the (cos, sin) of each of
        `packing`'s image rows, then of its text rows; None where they do not."""
        return None

    def output_rows(self, packing: Packing, inputs: Callable[[TokenLayout], tuple], replay: ReplayForward | None,
                    shards: SequenceShards | None) -> torch.Tensor | None:
        """`packing`'s forward's output rows (`run`), replaying `replay`'s templates (`replay`)
        or sequence parallel over `shards`' group (`sharded`), from its pieces' padded `inputs`."""
        if shards is not None:
            return self.sharded(packing, shards, inputs)
        if replay is not None:
            return self.replay(packing, token_pass(replay, packing), inputs)
        return self.run(packing, inputs)

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
        return self._run(("packed", rows, tokens), TokenLayout.of(packing, rows, tokens), inputs)

    def replay(self, packing: Packing, template: TemplatePass, inputs: Callable[[TokenLayout], tuple]) \
            -> torch.Tensor | None:
        """The output rows [tokens, ...] of `packing`'s forward replaying `template`'s templates,
        its pieces compiled at its buckets (computed tokens and all tokens, `replay x{rows}`);
        None where the step runs eagerly (counted, with why: an edit records, the load plan
        computes a block in full, past the largest bucket, a graph that failed)."""
        why = template.varies()
        if why is not None:
            return self.compiled.run(None, lambda: None, past=why)
        rows = self.compiled.bucket(len(packing.order))
        if rows is None:
            return self.compiled.run(None, lambda: None, past="rows")
        computed, text = template.rows(packing.image_index.device)
        buckets = self.buckets.by_kind.get(f"replay x{rows}", ())
        if not buckets or packing.image_rows > buckets[-1]:
            return self.compiled.run(None, lambda: None, past="tokens")
        tokens = next(b for b in buckets if b >= len(computed))
        texts = text_slots(rows, len(packing.order) if text is None else -(-len(text) // packing.text_len),
                           self.text_share)
        # the output piece runs over the row bucket's most tokens: one graph a computed bucket
        layout = TokenLayout.of(packing, rows, tokens, Replay(template, computed, text, buckets[-1],
                                                              self.rotation(packing)), texts)
        out = self._run(("replay", rows, tokens, texts), layout, inputs)
        if out is not None:
            template.count(computed, text, len(self.blocks), self._text_blocks)
            template.end()
        return out

    def sharded(self, packing: Packing, shards: SequenceShards, inputs: Callable[[TokenLayout], tuple]) \
            -> torch.Tensor | None:
        """The output rows [tokens, ...] of `packing`'s forward (images of one size) run sequence
        parallel over `shards`' group (Ulysses): this rank's shard of every row through the
        pieces, compiled at its row bucket, attention over the group's rows between them, every
        rank's output rows gathered after the last; None where the step runs eagerly (counted,
        with why: its techniques, past the largest row bucket, a graph that failed). Every rank
        runs the same collectives either way, so a rank whose graph failed stays in step."""
        rows = self.compiled.bucket(len(packing.order))
        if rows is None:
            return self.compiled.run(None, lambda: None, past="rows")
        shard = Shard.of(packing, shards)
        layout = TokenLayout.of(packing, rows, rows * len(shard.computed) // len(packing.order), shard)
        out = self._run(("ulysses", rows, layout.tokens, len(layout.text_index)), layout, inputs)
        return None if out is None else shard.gather(out, len(packing.order))

    def shard_graphs(self, shapes: Sequence[tuple[int, ...]], text_len: int, least: int,
                     ranks: Sequence[tuple[int, int]]) -> list[Graph]:
        """The pieces of Ulysses steps of each token layout of `shapes` at every row bucket from
        `least` rows (a request's), this process being rank r of a group of degree k for each
        (k, r) of `ranks`, to compile at warm-up without the groups (`Rehearsal`: a step's
        shapes, zeros exchanged): a shard's pieces depend on its shapes only."""
        out: dict[tuple, Graph] = {}
        for shape, rows, (degree, rank) in itertools.product(shapes, self.compiled.buckets, ranks):
            tokens = math.prod(shape)
            if rows < least or tokens % degree or self.blocks[0].attn.heads % degree:
                continue  # a size or model no step of that degree runs (refused)
            packing = self.example(rows, rows * tokens, text_len, shape)
            shard = Shard.of(packing, Rehearsal(degree, rank))
            layout = TokenLayout.of(packing, rows, len(shard.computed), shard)
            key = ("ulysses", rows, layout.tokens, len(layout.text_index))
            out.setdefault(key, Graph(key, lambda layout=layout: self.pieces(layout, *self.inputs(layout)),
                                      self.describe(key)))
        return list(out.values())

    def graphs(self, text_len: int) -> list[Graph]:
        """Every bucket's pieces, to compile at warm-up, for prompts of `text_len` rows (one
        example packing each: a bucket's graphs do not depend on which mix fills it)."""
        out = []
        for kind, tokens in self.buckets.by_kind.items():
            what, rows = kind.split(" x")
            rows = int(rows)
            for t in tokens:
                if what == "tokens":
                    layout = TokenLayout.of(self.example(rows, t, text_len), rows, t)
                    key = ("packed", rows, t)
                else:  # a replay computing t tokens of the row bucket's most and the text of the rows
                    # that usually compute it (`text_share`), the templates blank
                    packing = self.example(rows, tokens[-1], text_len)
                    computed = torch.arange(min(t, packing.image_rows), device=packing.image_index.device)
                    texts = text_slots(rows, rows // self.text_share, self.text_share)
                    text = torch.arange(texts * text_len, device=computed.device)
                    layout = TokenLayout.of(packing, rows, t, Replay(_Blank(), computed, text, tokens[-1],
                                                                     self.rotation(packing)), texts)
                    key = ("replay", rows, t, texts)
                out.append(Graph(key, lambda layout=layout: self.pieces(layout, *self.inputs(layout)),
                                 self.describe(key)))
        return out

    @staticmethod
    def describe(key: tuple) -> str:
        if key[0] == "ulysses":
            return f"Ulysses shard of {key[1]} rows, {key[2]} image tokens and {key[3]} text rows"
        if key[0] == "replay":
            return f"template replay {key[1]} rows, {key[2]} tokens computed, the text of {key[3]} rows"
        return f"packed {key[1]} rows, {key[2]} tokens"

    def example(self, rows: int, tokens: int, text_len: int, shape: tuple[int, ...] | None = None) -> Packing:
        """A packing of `rows` rows whose image tokens fill at most `tokens` (each of token
        layout `shape`, where given), `text_len` text rows each."""
        raise NotImplementedError

    def inputs(self, layout: TokenLayout) -> tuple:
        """Warm-up inputs of `layout`'s shapes (values do not matter)."""
        raise NotImplementedError


# -- what the pieces of MMDiT joint blocks (SD3's, Flux's double-stream) share ------------------

def zero(norm: nn.Module, temb: torch.Tensor, chunks: int = 6) -> tuple[torch.Tensor, ...]:
    """An AdaLayerNormZero's (or its single-stream kind's) modulations per slot [rows, D]."""
    return norm.linear(norm.silu(temb)).chunk(chunks, dim=1)


def output(transformer: nn.Module, x: torch.Tensor, temb: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A DiT's output rows [tokens, C_out]: its output norm, modulated per slot, and projection."""
    return transformer.proj_out(continuous(transformer.norm_out, x, temb, index))


def last(finish: Callable, transformer: nn.Module, done: nn.Module, x, c, temb, image_out, text_out, carry, *rows):
    """The last block's end and the output rows [tokens, C_out] (`rows[0]`: each image row's slot)."""
    return output(transformer, finish(transformer, done, x, c, temb, image_out, text_out, carry, *rows), temb, rows[0])


def replayed_last(finish: Callable, transformer: nn.Module, done: nn.Module, x, c, temb, image_out, text_out, carry,
                  full: torch.Tensor, scatter: torch.Tensor, index: torch.Tensor, *rows):
    """A replay's last piece: the last block's end for the computed rows, put among the
    templates' rows of every token (`Replay.outputs`), and the output rows of every token
    [len(index), C_out]."""
    x = finish(transformer, done, x, c, temb, image_out, text_out, carry, *rows)
    return output(transformer, full.index_copy(0, scatter, x)[:len(index)], temb, index)


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
