"""SD3's packed forward as compiled pieces (`runner/pieces.py` says how): rows [tokens, D] and
text rows [rows * L, D], every AdaLN modulation computed per slot and gathered by each row's
slot, in the order of the model's own block (`JointTransformerBlock`), so each row's values are
those of its image's own forward. SD3.5's second (image-only) attention is not a piece yet: a
model with it runs its packed steps eagerly (`supports`)."""

from __future__ import annotations

import math
from itertools import pairwise

import torch
from torch import nn

from gouache.attention import QKV, project
from gouache.runner.buckets import Buckets
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.pack_dit import Packing
from gouache.runner.pieces import PackedPieces, TokenLayout


def supports(transformer: nn.Module) -> bool:
    """Whether SD3's pieces hold every block of `transformer` (no dual attention, no chunked
    feed-forward) and its patch embedding crops a sincos table."""
    blocks = transformer.transformer_blocks
    return bool(transformer.pos_embed.pos_embed_max_size) and not any(
        b.use_dual_attention or b._chunk_size is not None for b in blocks)


def _zero(norm: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An AdaLayerNormZero's six modulations per slot [rows, D]."""
    return norm.linear(norm.silu(temb)).chunk(6, dim=1)


def _modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale)[index] + shift[index]


def _continuous(norm: nn.Module, x: torch.Tensor, temb: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An AdaLayerNormContinuous over rows, its modulation gathered by `index`."""
    scale, shift = norm.linear(norm.silu(temb).to(x.dtype)).chunk(2, dim=1)
    return _modulate(norm.norm(x), scale, shift, index)


def _qkv(block: nn.Module, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor, image_index: torch.Tensor,
         text_index: torch.Tensor) -> tuple[QKV, QKV]:
    """A block's attention inputs: its image and text rows' q, k, v [rows, H, d]."""
    attn = block.attn
    shift, scale = _zero(block.norm1, temb)[:2]
    x = _modulate(block.norm1.norm(x), scale, shift, image_index)
    if block.context_pre_only:
        c = _continuous(block.norm1_context, c, temb, text_index)
    else:
        c_shift, c_scale = _zero(block.norm1_context, temb)[:2]
        c = _modulate(block.norm1_context.norm(c), c_scale, c_shift, text_index)
    image = project(x, attn.heads, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
    text = project(c, attn.heads, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                   (attn.norm_added_q, attn.norm_added_k))
    return image, text


def _finish(block: nn.Module, x: torch.Tensor, c: torch.Tensor, temb: torch.Tensor, image_out: torch.Tensor,
            text_out: torch.Tensor, image_index: torch.Tensor, text_index: torch.Tensor):
    """A block's rows after its attention: (x, c), c None after a block that keeps no text."""
    attn = block.attn
    _, _, gate, shift_mlp, scale_mlp, gate_mlp = _zero(block.norm1, temb)
    x = x + gate[image_index] * attn.to_out[1](attn.to_out[0](image_out))
    ff = block.ff(_modulate(block.norm2(x), scale_mlp, shift_mlp, image_index))
    x = x + gate_mlp[image_index] * ff
    if block.context_pre_only:
        return x, None
    _, _, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = _zero(block.norm1_context, temb)
    c = c + c_gate[text_index] * attn.to_add_out(text_out)
    ff = block.ff_context(_modulate(block.norm2_context(c), c_scale_mlp, c_shift_mlp, text_index))
    return x, c + c_gate_mlp[text_index] * ff


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
    return x, c, temb, *_qkv(block, x, c, temb, image_index, text_index)


def between(done: nn.Module, block: nn.Module, x, c, temb, image_out, text_out, image_index, text_index):
    """The end of one block and the next one's attention inputs."""
    x, c = _finish(done, x, c, temb, image_out, text_out, image_index, text_index)
    return x, c, *_qkv(block, x, c, temb, image_index, text_index)


def last(transformer: nn.Module, done: nn.Module, x, c, temb, image_out, text_out, image_index, text_index):
    """The last block's end and the output rows [tokens, p * p * C_out]."""
    x, _ = _finish(done, x, c, temb, image_out, text_out, image_index, text_index)
    return transformer.proj_out(_continuous(transformer.norm_out, x, temb, image_index))


class SD3Pieces(PackedPieces):
    """SD3's packed forward in pieces: `forward` takes what `packed_sd3_forward` takes."""

    def __init__(self, transformer: nn.Module, compiled: CompiledDenoiser, buckets: Buckets):
        super().__init__(compiled, buckets)
        self.transformer = transformer
        self._first, self._between, self._last = map(compiled.compile, (first, between, last))
        self._pos: dict[tuple[int, int], torch.Tensor] = {}  # a token grid's sincos rows

    def forward(self, samples: list[torch.Tensor], timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor) -> list[torch.Tensor] | None:
        """Per sample [C, h, w], its prediction [C_out, h, w]; None where the step runs eagerly."""
        p = self.transformer.config.patch_size
        shapes = [(x.shape[1] // p, x.shape[2] // p) for x in samples]
        packing = Packing.build(shapes, encoder_hidden_states.shape[1], samples[0].device)

        def inputs(layout: TokenLayout) -> tuple:
            return (layout.image(packing.pack([patch_rows(x, p) for x in samples])), self.positions(layout),
                    layout.text(packing.text(encoder_hidden_states)[:, 0]), layout.slots(timestep),
                    layout.slots(pooled_projections))

        out = self.run(packing, inputs)
        if out is None:
            return None
        rows = out[:packing.image_rows].unflatten(1, (p, p, -1)).permute(0, 3, 1, 2)  # [S_img, C_out, p, p]
        return [latent_grid(part, shape) for part, shape in zip(packing.unpack(rows), shapes)]

    def pieces(self, layout: TokenLayout, patches, pos, text, timestep, pooled) -> torch.Tensor:
        blocks = self.transformer.transformer_blocks
        index = layout.image_index, layout.text_index
        x, c, temb, image, text_qkv = self._first(self.transformer, blocks[0], patches, pos, text, timestep, pooled,
                                                  *index)
        for done, block in pairwise(blocks):
            attended = layout.attend(image, text_qkv, text_first=False)
            x, c, image, text_qkv = self._between(done, block, x, c, temb, *attended, *index)
        return self._last(self.transformer, blocks[-1], x, c, temb, *layout.attend(image, text_qkv, False), *index)

    def positions(self, layout: TokenLayout) -> torch.Tensor:
        """Each image row's sincos embedding [tokens, D], in packed order (padding: zeros)."""
        embed = self.transformer.pos_embed
        parts = []
        for group in layout.packing.groups:
            if group.shape not in self._pos:
                h, w = group.shape
                self._pos[group.shape] = embed.cropped_pos_embed(h * embed.patch_size, w * embed.patch_size)[0]
            parts.append(self._pos[group.shape].repeat(group.count, 1))
        return layout.image(torch.cat(parts))

    def example(self, rows: int, tokens: int, text_len: int) -> Packing:
        side = min(math.isqrt(tokens // rows), self.transformer.pos_embed.pos_embed_max_size)
        return Packing.build([(side, side)] * rows, text_len, self.transformer.device)

    def inputs(self, layout: TokenLayout) -> tuple:
        config, device, dtype = self.transformer.config, self.transformer.device, self.transformer.dtype
        p = config.patch_size
        return (torch.zeros(layout.tokens, config.in_channels, p, p, device=device, dtype=dtype),
                self.positions(layout),
                torch.zeros(layout.rows * layout.packing.text_len, config.joint_attention_dim, device=device,
                            dtype=dtype),
                torch.full((layout.rows,), 500.0, device=device, dtype=dtype),
                torch.zeros(layout.rows, config.pooled_projection_dim, device=device, dtype=dtype))


def patch_rows(x: torch.Tensor, p: int) -> torch.Tensor:
    """A latent [C, h, w] as one DiT patch per row [h/p * w/p, C, p, p], raster order."""
    return x.unflatten(1, (-1, p)).unflatten(3, (-1, p)).permute(1, 3, 0, 2, 4).flatten(0, 1)


def latent_grid(rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """An image's patch rows [h * w, C, p, p] as its latent [C, h * p, w * p]."""
    return rows.unflatten(0, shape).permute(2, 0, 3, 1, 4).flatten(1, 2).flatten(2, 3)
