"""Packed inference for SD3 (`pack_dit` has the packing, and describes it): the stand-ins for
SD3's patch embedding, blocks, output norm and attention processor over packed rows, and the
forward that swaps them in."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0
from torch import nn

from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.runner.pack_dit import Packing, Run, image_qkv, per_image, swapped, text_qkv, token_pass


class PackedPosEmbed(nn.Module):
    """Stands in for SD3's PatchEmbed over rows of one DiT patch each [S_img, C, p, p]: the same
    projection, plus each token's entry of its image's cropped sincos embedding."""

    def __init__(self, embed: nn.Module, packing: Packing):
        super().__init__()
        if not embed.pos_embed_max_size:
            raise ValueError("packed SD3 needs the cropped pos-embed (pos_embed_max_size set)")
        self.embed = embed
        size = embed.patch_size
        pos = [embed.cropped_pos_embed(g.shape[0] * size, g.shape[1] * size)[0].repeat(g.count, 1)  # raster order
               for g in packing.groups]
        self.register_buffer("pos", torch.cat(pos)[:, None], persistent=False)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        x = self.embed.proj(latent).flatten(2).transpose(1, 2)  # [S, C, p, p] -> [S, 1, D]
        if self.embed.layer_norm:
            x = self.embed.norm(x)
        return (x + self.pos).to(x.dtype)


def _modulations(norm: nn.Module, temb: torch.Tensor, packing: Packing, chunks: int,
                 dtype=None) -> tuple[torch.Tensor, ...]:
    """An AdaLN norm's modulations per image [num_images, D] each, in packed order."""
    emb = norm.silu(temb)
    emb = norm.linear(emb if dtype is None else emb.to(dtype))
    return emb.index_select(0, packing.positions).chunk(chunks, dim=1)


class PackedContinuousNorm(nn.Module):
    """Stands in for an AdaLayerNormContinuous (SD3's `norm_out`) over packed image rows."""

    def __init__(self, norm: nn.Module, packing: Packing):
        super().__init__()
        self.norm, self.packing = norm, packing

    def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
        return continuous(self.norm, x, conditioning_embedding, self.packing, self.packing.runs())


def continuous(norm: nn.Module, x: torch.Tensor, temb: torch.Tensor, packing: Packing, runs: list[Run]) -> torch.Tensor:
    scale, shift = _modulations(norm, temb, packing, 2, x.dtype)
    return per_image(norm.norm(x), runs, 1 + scale, shift)


class PackedJointBlock(nn.Module):
    """Stands in for an SD3 JointTransformerBlock over packed rows: its own layers, in its order,
    with every modulation and gate applied per run (`per_image`)."""

    def __init__(self, block: nn.Module, packing: Packing):
        super().__init__()
        if block._chunk_size is not None:
            raise ValueError("packed inference does not chunk feed-forwards; unset the block's chunk size")
        self.block, self.packing = block, packing
        self.context_pre_only = block.context_pre_only  # the model reads it (ControlNet residuals)

    def forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
        block, packing, kwargs = self.block, self.packing, joint_attention_kwargs or {}
        image, text = packing.runs(), packing.runs(text=True)
        mod = _modulations(block.norm1, temb, packing, 9 if block.use_dual_attention else 6)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod[:6]
        normed = block.norm1.norm(hidden_states)
        norm_image = per_image(normed, image, 1 + scale_msa, shift_msa)
        if block.context_pre_only:
            norm_text = continuous(block.norm1_context, encoder_hidden_states, temb, packing, text)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _modulations(
                block.norm1_context, temb, packing, 6)
            norm_text = per_image(block.norm1_context.norm(encoder_hidden_states), text, 1 + c_scale_msa, c_shift_msa)
        attn_image, attn_text = block.attn(hidden_states=norm_image, encoder_hidden_states=norm_text, **kwargs)
        hidden_states = hidden_states + per_image(attn_image, image, gate_msa)
        if block.use_dual_attention:
            shift_msa2, scale_msa2, gate_msa2 = mod[6:]
            attn2 = block.attn2(hidden_states=per_image(normed, image, 1 + scale_msa2, shift_msa2), **kwargs)
            hidden_states = hidden_states + per_image(attn2, image, gate_msa2)
        ff = block.ff(per_image(block.norm2(hidden_states), image, 1 + scale_mlp, shift_mlp))
        hidden_states = hidden_states + per_image(ff, image, gate_mlp)
        if block.context_pre_only:
            return None, hidden_states
        encoder_hidden_states = encoder_hidden_states + per_image(attn_text, text, c_gate_msa)
        ff = block.ff_context(per_image(block.norm2_context(encoder_hidden_states), text, 1 + c_scale_mlp, c_shift_mlp))
        return encoder_hidden_states + per_image(ff, text, c_gate_mlp), hidden_states


class PackedJointAttnProcessor:
    """JointAttnProcessor2_0 over packed rows (also serves SD3.5's image-only `attn2`)."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        image = image_qkv(self.packing, attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v),
                          (attn.norm_q, attn.norm_k))
        text = None if encoder_hidden_states is None else text_qkv(self.packing, attn, encoder_hidden_states)
        image_out, text_out = self.packing.attend(image, text, text_first=False)
        image_out = attn.to_out[1](attn.to_out[0](image_out[:, None]))
        if text is None:
            return image_out
        text_out = text_out[:, None]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


def packed_sd3_forward(
    transformer: nn.Module,
    samples: list[torch.Tensor],
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor,
    whole_batches: bool = True,
    cache: CachedForward | None = None,
) -> list[torch.Tensor]:
    """SD3 transformer over latents of mixed sizes in one forward.

    samples: [C, h, w] latents (caller order); timestep [num_images]; encoder_hidden_states
    [num_images, L, D]; pooled_projections [num_images, D']. Returns [C_out, h, w] per image,
    equal to each image's own forward. With a `cache`, blocks reuse cached outputs per token.
    """
    if whole_batches and len({x.shape for x in samples}) == 1:
        with cached_blocks(transformer, cache and cache.begin()):
            return list(transformer(hidden_states=torch.stack(samples), timestep=timestep,
                                    encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                    return_dict=False)[0])
    p = transformer.config.patch_size
    shapes = [(x.shape[1] // p, x.shape[2] // p) for x in samples]
    packing = Packing.build(shapes, encoder_hidden_states.shape[1], samples[0].device)
    rows = [patch_rows(x, p) for x in samples]
    blocks = transformer.transformer_blocks
    swaps = [(transformer, "pos_embed", PackedPosEmbed(transformer.pos_embed, packing)),
             (transformer, "norm_out", PackedContinuousNorm(transformer.norm_out, packing)),
             *((blocks, str(i), PackedJointBlock(block, packing)) for i, block in enumerate(blocks))]
    with (swapped(transformer, PackedJointAttnProcessor(packing), JointAttnProcessor2_0, swaps),
          cached_blocks(transformer, token_pass(cache, packing), "token", packing)):
        out = transformer(
            hidden_states=packing.pack(rows),
            timestep=timestep,
            encoder_hidden_states=packing.text(encoder_hidden_states),
            pooled_projections=pooled_projections,
            return_dict=False,
        )[0]  # [S_img, C_out, p, p]
    return [latent_grid(part, shape) for part, shape in zip(packing.unpack(out), shapes)]


def patch_rows(x: torch.Tensor, p: int) -> torch.Tensor:
    """A latent [C, h, w] as one DiT patch per row [h/p * w/p, C, p, p], raster order."""
    return x.unflatten(1, (-1, p)).unflatten(3, (-1, p)).permute(1, 3, 0, 2, 4).flatten(0, 1)


def latent_grid(rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """An image's patch rows [h * w, C, p, p] as its latent [C, h * p, w * p]."""
    return rows.unflatten(0, shape).permute(2, 0, 3, 1, 4).flatten(1, 2).flatten(2, 3)
