"""Flux's packed forward as compiled pieces (`runner/pieces.py` says how): its double-stream
blocks are joint blocks as SD3's (text first), its single-stream blocks run text and image rows
as one stream, and RoPE is data too: each row's rotation (its image's own ids, a FLUX.1 Kontext
reference's after them; every text row's the text ids') is an input, applied to queries and
keys inside the pieces, so attention between them is plain per image."""

from __future__ import annotations

import math

import torch
from diffusers.models.embeddings import apply_rotary_emb
from torch import nn

from gouache.attention import QKV, project
from gouache.parallel.ulysses import SequenceShards
from gouache.runner.buckets import Buckets
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.pack_dit import Packing
from gouache.runner.pack_flux import layout_ids, own_grid
from gouache.runner.pieces import PackedPieces, TokenLayout, joint_finish, joint_qkv, modulate, zero
from gouache.templates.replay import ReplayForward


def supports(transformer: nn.Module) -> bool:
    """Whether Flux's pieces hold `transformer`: packed latents in, double- then single-stream blocks."""
    return transformer.config.patch_size == 1 and len(transformer.transformer_blocks) > 0


def _rotate(qkv: QKV, cos: torch.Tensor, sin: torch.Tensor) -> QKV:
    q, k, v = qkv
    return (apply_rotary_emb(q[None], (cos, sin), sequence_dim=1)[0],
            apply_rotary_emb(k[None], (cos, sin), sequence_dim=1)[0], v)


def _clip(x: torch.Tensor) -> torch.Tensor:
    """Half-precision rows clipped to its range, as Flux's blocks do."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def _start(block: nn.Module, x, c, temb, image_index, text_index, image_cos, image_sin, text_cos, text_sin):
    """A block's attention inputs (rotated) and its carry: the single-stream MLP rows, or None."""
    if not hasattr(block, "proj_mlp"):  # a double-stream block
        image, text = joint_qkv(block, x, c, temb, image_index, text_index)
        return _rotate(image, image_cos, image_sin), _rotate(text, text_cos, text_sin), None
    rows = torch.cat([c, x])  # text rows, then image rows: one stream
    shift, scale, _ = zero(block.norm, temb, 3)
    normed = modulate(block.norm.norm(rows), scale, shift, torch.cat([text_index, image_index]))
    attn, split = block.attn, len(c)
    qkv = project(normed, attn.heads, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
    qkv = _rotate(qkv, torch.cat([text_cos, image_cos]), torch.cat([text_sin, image_sin]))
    mlp = block.act_mlp(block.proj_mlp(normed))
    return tuple(t[split:] for t in qkv), tuple(t[:split] for t in qkv), mlp


def _end(block: nn.Module, x, c, temb, image_out, text_out, mlp, image_index, text_index):
    """A block's rows after its attention: (x, c)."""
    if mlp is None:
        x, c = joint_finish(block, x, c, temb, image_out, text_out, image_index, text_index)
        return x, _clip(c)
    gate = zero(block.norm, temb, 3)[2]
    out = block.proj_out(torch.cat([torch.cat([text_out, image_out]), mlp], dim=1))
    rows = _clip(torch.cat([c, x]) + gate[torch.cat([text_index, image_index])] * out)
    return rows[len(c):], rows[:len(c)]


def first(transformer: nn.Module, block: nn.Module, tokens: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor,
          guidance: torch.Tensor | None, pooled: torch.Tensor, *rows):
    """The embeddings and the first block's attention inputs."""
    x = transformer.x_embedder(tokens)
    timestep = timestep.to(x.dtype) * 1000
    if guidance is None:
        temb = transformer.time_text_embed(timestep, pooled)
    else:
        temb = transformer.time_text_embed(timestep, guidance.to(x.dtype) * 1000, pooled)
    c = transformer.context_embedder(text)
    return x, c, temb, *_start(block, x, c, temb, *rows)


def between(done: nn.Module, block: nn.Module, x, c, temb, image_out, text_out, carry, *rows):
    """The end of one block and the next one's attention inputs."""
    x, c = _end(done, x, c, temb, image_out, text_out, carry, *rows[:2])
    return x, c, *_start(block, x, c, temb, *rows)


def finish(transformer: nn.Module, done: nn.Module, x, c, temb, image_out, text_out, carry, *rows):
    """The last block's image rows after its attention."""
    return _end(done, x, c, temb, image_out, text_out, carry, *rows[:2])[0]


class FluxPieces(PackedPieces):
    """Flux's packed forward in pieces: `forward` takes what `packed_flux_forward` takes."""

    text_first = True
    joined = True

    def __init__(self, transformer: nn.Module, compiled: CompiledDenoiser, buckets: Buckets):
        blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
        super().__init__(transformer, blocks, compiled, buckets, first, between, finish)
        self.txt_ids: torch.Tensor | None = None  # the text rows' ids of the step (the same for every prompt)
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # a token layout's rotation

    def forward(self, grids: list[torch.Tensor], timestep: torch.Tensor, guidance: torch.Tensor | None,
                pooled_projections: torch.Tensor, encoder_hidden_states: torch.Tensor,
                txt_ids: torch.Tensor, replay: ReplayForward | None = None,
                shards: SequenceShards | None = None) -> list[torch.Tensor] | None:
        """Per grid [C, h, w] (or [C, 2, h, w] with a reference), its prediction [C, h, w] (with
        `replay`, its edits replaying their templates; with `shards`, run sequence parallel over
        their group); None where the step runs eagerly."""
        shapes = [tuple(x.shape[1:]) for x in grids]
        packing = Packing.build(shapes, encoder_hidden_states.shape[1], grids[0].device)
        self.txt_ids = txt_ids

        def inputs(layout: TokenLayout) -> tuple:
            return (layout.image(packing.pack([x.flatten(1).T for x in grids])),
                    layout.text(packing.text(encoder_hidden_states)[:, 0]), layout.slots(timestep),
                    None if guidance is None else layout.slots(guidance), layout.slots(pooled_projections))

        out = self.output_rows(packing, inputs, replay, shards)
        if out is None:
            return None
        return [own_grid(part, shape) for part, shape in zip(packing.unpack(out[:packing.image_rows]), shapes)]

    def rows(self, layout: TokenLayout) -> tuple[torch.Tensor, ...]:
        """Each row's slot, and each image row's and text row's RoPE (cos, sin) [rows, d]."""
        image_cos, image_sin, text_cos, text_sin = self.rotation(layout.packing)
        return (layout.image_index, layout.text_index, layout.image(image_cos), layout.image(image_sin),
                layout.text(text_cos), layout.text(text_sin))

    def rotation(self, packing: Packing) -> tuple[torch.Tensor, ...]:
        image = [self._rotation(group.shape) for group in packing.groups for _ in range(group.count)]
        text = self._rotation(())
        return (*(torch.cat([r[i] for r in image]) for i in (0, 1)),
                *(text[i].repeat(len(packing.order), 1) for i in (0, 1)))

    def _rotation(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE (cos, sin) of a token layout's rows (kept), or of the step's text rows (shape ())."""
        if shape == ():
            return self.model.pos_embed(self.txt_ids)
        if shape not in self._rope:
            self._rope[shape] = self.model.pos_embed(layout_ids(shape, self.txt_ids))
        return self._rope[shape]

    def example(self, rows: int, tokens: int, text_len: int, shape: tuple[int, ...] | None = None) -> Packing:
        side = max(1, math.isqrt(tokens // rows))
        self.txt_ids = torch.zeros(text_len, 3, device=self.model.device, dtype=self.model.dtype)
        return Packing.build([shape or (side, side)] * rows, text_len, self.model.device)

    def inputs(self, layout: TokenLayout) -> tuple:
        config, device, dtype = self.model.config, self.model.device, self.model.dtype
        guidance = torch.ones(layout.rows, device=device, dtype=dtype) if config.guidance_embeds else None
        return (torch.zeros(layout.tokens, config.in_channels, device=device, dtype=dtype),
                torch.zeros(len(layout.text_index), config.joint_attention_dim, device=device,
                            dtype=dtype),
                torch.full((layout.rows,), 0.5, device=device, dtype=dtype), guidance,
                torch.zeros(layout.rows, config.pooled_projection_dim, device=device, dtype=dtype))
