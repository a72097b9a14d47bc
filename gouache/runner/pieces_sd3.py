"""SD3's packed forward as compiled pieces (`runner/pieces.py` says how): image rows [tokens, D]
and text rows [rows * L, D] through the model's joint blocks, every modulation computed per slot
and gathered by each row's slot, in the order of the model's own block, so each row's values are
those of its image's own forward. SD3.5's second (image-only) attention is not a piece yet: a
model with it runs its packed steps eagerly (`supports`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from gouache.parallel.ulysses import SequenceShards
from gouache.runner.buckets import Buckets
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.pack_dit import Packing
from gouache.runner.pack_sd3 import latent_grid, patch_rows
from gouache.runner.pieces import PackedPieces, TokenLayout, joint_finish, joint_qkv
from gouache.templates.replay import ReplayForward


def supports(transformer: nn.Module) -> bool:
    """Whether SD3's pieces hold every block of `transformer` (no dual attention, no chunked
    feed-forward) and its patch embedding crops a sincos table."""
    blocks = transformer.transformer_blocks
    return bool(transformer.pos_embed.pos_embed_max_size) and not any(
        b.use_dual_attention or b._chunk_size is not None for b in blocks)


def first(transformer: nn.Module, block: nn.Module, patches: torch.Tensor, pos: torch.Tensor, text: torch.Tensor,
          timestep: torch.Tensor, pooled: torch.Tensor, image_index: torch.Tensor, text_index: torch.Tensor):
    """The embeddings and the first block's attention inputs."""
    embed = transformer.pos_embed
    x = embed.proj(patches).flatten(1)  # [tokens, C, p, p] -> [tokens, D]
    if embed.layer_norm:
        x = embed.norm(x)
    x = (x + pos).to(x.dtype)
    temb = transformer.time_text_embed(timestep, pooled)
    c = transformer.context_embedder(text)
    return x, c, temb, *joint_qkv(block, x, c, temb, image_index, text_index), None


def between(done: nn.Module, block: nn.Module, x, c, temb, image_out, text_out, carry, image_index, text_index):
    """The end of one block and the next one's attention inputs."""
    x, c = joint_finish(done, x, c, temb, image_out, text_out, image_index, text_index)
    return x, c, *joint_qkv(block, x, c, temb, image_index, text_index), None


def finish(transformer: nn.Module, done: nn.Module, x, c, temb, image_out, text_out, carry, image_index, text_index):
    """The last block's image rows after its attention."""
    return joint_finish(done, x, c, temb, image_out, text_out, image_index, text_index)[0]


class SD3Pieces(PackedPieces):
    """SD3's packed forward in pieces: `forward` takes what `packed_sd3_forward` takes."""

    text_share = 2  # its edits run CFG: a replay computes the conditional rows' text

    def __init__(self, transformer: nn.Module, compiled: CompiledDenoiser, buckets: Buckets):
        super().__init__(transformer, transformer.transformer_blocks, compiled, buckets, first, between, finish)
        self._pos: dict[tuple[int, int], torch.Tensor] = {}  # a token grid's sincos rows

    def forward(self, samples: list[torch.Tensor], timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, replay: ReplayForward | None = None,
                shards: SequenceShards | None = None) -> list[torch.Tensor] | None:
        """Per sample [C, h, w], its prediction [C_out, h, w] (with `replay`, its edits replaying
        their templates; with `shards`, run sequence parallel over their group); None where the
        step runs eagerly."""
        p = self.model.config.patch_size
        shapes = [(x.shape[1] // p, x.shape[2] // p) for x in samples]
        packing = Packing.build(shapes, encoder_hidden_states.shape[1], samples[0].device)

        def inputs(layout: TokenLayout) -> tuple:
            return (layout.image(packing.pack([patch_rows(x, p) for x in samples])), self.positions(layout),
                    layout.text(packing.text(encoder_hidden_states)[:, 0]), layout.slots(timestep),
                    layout.slots(pooled_projections))

        out = self.output_rows(packing, inputs, replay, shards)
        if out is None:
            return None
        rows = out[:packing.image_rows].unflatten(1, (p, p, -1)).permute(0, 3, 1, 2)  # [S_img, C_out, p, p]
        return [latent_grid(part, shape) for part, shape in zip(packing.unpack(rows), shapes)]

    def positions(self, layout: TokenLayout) -> torch.Tensor:
        """Each image row's sincos embedding [tokens, D], in packed order (padding: zeros)."""
        embed = self.model.pos_embed
        parts = []
        for group in layout.packing.groups:
            if group.shape not in self._pos:
                h, w = group.shape
                self._pos[group.shape] = embed.cropped_pos_embed(h * embed.patch_size, w * embed.patch_size)[0]
            parts.append(self._pos[group.shape].repeat(group.count, 1))
        return layout.image(torch.cat(parts))

    def example(self, rows: int, tokens: int, text_len: int, shape: tuple[int, ...] | None = None) -> Packing:
        side = min(math.isqrt(tokens // rows), self.model.pos_embed.pos_embed_max_size)
        return Packing.build([shape or (side, side)] * rows, text_len, self.model.device)

    def inputs(self, layout: TokenLayout) -> tuple:
        config, device, dtype = self.model.config, self.model.device, self.model.dtype
        p = config.patch_size
        return (torch.zeros(layout.tokens, config.in_channels, p, p, device=device, dtype=dtype),
                self.positions(layout),
                torch.zeros(len(layout.text_index), config.joint_attention_dim, device=device,
                            dtype=dtype),
                torch.full((layout.rows,), 500.0, device=device, dtype=dtype),
                torch.zeros(layout.rows, config.pooled_projection_dim, device=device, dtype=dtype))

