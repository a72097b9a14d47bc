"""Packed inference for Flux (`pack_dit` has the packing, and SD3): images of different sizes in
ONE forward, every token computed once.

Flux's RoPE is made per size from each image's own ids; its single-stream blocks concatenate
text and image along the sequence, so they get all rows as one stream (text rows, then image
rows) and an empty text stream (`RowsSingleBlock`). An image may carry a reference of its own
size after its tokens (FLUX.1 Kontext): its sample is then [C, 2, h, w], the reference's ids'
first coordinate 1, as `FluxKontextPipeline` makes them.
"""

from __future__ import annotations

import torch
from diffusers import FluxPipeline
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import nn

from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.runner.pack_dit import Packing, image_qkv, norm_swaps, swapped, text_qkv, token_pass


class PackedRotary(nn.Module):
    """Stands in for FluxPosEmbed: per size, the RoPE of [text, one image's tokens] from the
    image's own ids."""

    def __init__(self, rope: nn.Module, packing: Packing):
        super().__init__()
        self.rope = rope
        self.packing = packing

    def forward(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        txt_ids = ids[: self.packing.text_len]
        return [self.rope(torch.cat([txt_ids, layout_ids(g.shape, ids)])) for g in self.packing.groups]


def layout_ids(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The ids of a token layout's tokens (`Packing.shapes`), of `like`'s device and dtype: a
    grid's (0, row, column), then each further grid's with its number first."""
    *stacked, h, w = shape
    ids = FluxPipeline._prepare_latent_image_ids(1, h, w, like.device, like.dtype)
    if not stacked:
        return ids
    grids = ids.repeat(stacked[0], 1)
    grids[:, 0] = torch.arange(stacked[0], device=like.device, dtype=like.dtype).repeat_interleave(h * w)
    return grids


class PackedFluxAttnProcessor:
    """FluxAttnProcessor over packed rows, in both block kinds."""

    def __init__(self, packing: Packing):
        self.packing = packing

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:  # Flux pipelines pass none; a padded-text mask would need per-image work
            raise NotImplementedError("packed Flux attention takes no attention mask")
        norms, own = (attn.norm_q, attn.norm_k), (attn.to_q, attn.to_k, attn.to_v)
        if encoder_hidden_states is None:  # single-stream: text rows, then image rows
            split, every = self.packing.text_rows_computed, len(self.packing.text_index)  # queries, keys
            q, k, v = image_qkv(self.packing, attn, hidden_states[split:], own, norms, text_rows=hidden_states[:split])
            text, image = (q[:split], k[:every], v[:every]), (q[split:], k[every:], v[every:])
        else:
            image = image_qkv(self.packing, attn, hidden_states, own, norms)
            text = text_qkv(self.packing, attn, encoder_hidden_states)
        image_out, text_out = self.packing.attend(image, text, text_first=True, rope=image_rotary_emb)
        if encoder_hidden_states is None:
            return torch.cat([text_out, image_out])[:, None]
        return attn.to_out[1](attn.to_out[0](image_out[:, None])), attn.to_add_out(text_out[:, None])


class RowsSingleBlock(nn.Module):
    """A Flux single-stream block over packed rows: its text and image rows go through as one
    stream (the block concatenates along the sequence, which rows of one token cannot)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        rows = torch.cat([encoder_hidden_states, hidden_states])
        _, out = self.block(rows, rows[:, :0], temb, image_rotary_emb, joint_attention_kwargs)
        return out[: len(encoder_hidden_states)], out[len(encoder_hidden_states):]


def packed_flux_forward(
    transformer: nn.Module,
    samples: list[torch.Tensor],
    timestep: torch.Tensor,
    guidance: torch.Tensor | None,
    pooled_projections: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    txt_ids: torch.Tensor,
    whole_batches: bool = True,
    cache: CachedForward | None = None,
) -> list[torch.Tensor]:
    """Flux transformer over images of mixed sizes in one forward.

    samples: [C_packed, h_tok, w_tok] token grids (caller order), or [C_packed, 2, h_tok, w_tok]:
    the image's grid and its reference's; timestep [num_images] (already /1000); guidance
    [num_images] or None; pooled_projections [num_images, D']; encoder_hidden_states
    [num_images, L, D]; txt_ids [L, 3]. Returns [C_packed, h_tok, w_tok] per image (its own
    tokens), equal to each image's own forward. With a `cache`, blocks reuse cached outputs per
    token.
    """
    if transformer.config.patch_size != 1:
        raise ValueError("packed Flux expects packed latents (transformer patch_size 1)")
    shapes = [tuple(x.shape[1:]) for x in samples]
    if whole_batches and len(set(shapes)) == 1:
        with cached_blocks(transformer, cache and cache.begin()):
            out = transformer(hidden_states=torch.stack([x.flatten(1).T for x in samples]), timestep=timestep,
                              guidance=guidance, pooled_projections=pooled_projections,
                              encoder_hidden_states=encoder_hidden_states, txt_ids=txt_ids,
                              img_ids=layout_ids(shapes[0], txt_ids), return_dict=False)[0]
        return [own_grid(x, shapes[0]) for x in out]
    packing = Packing.build(shapes, encoder_hidden_states.shape[1], samples[0].device)
    all_rows = torch.cat([packing.text_index, packing.image_index])
    swaps = [(transformer, "pos_embed", PackedRotary(transformer.pos_embed, packing)),
             norm_swaps(transformer.norm_out, packing.image_index)]
    for block in transformer.transformer_blocks:
        swaps += [norm_swaps(block.norm1, packing.image_index, packing),
                  norm_swaps(block.norm1_context, packing.text_index, packing, len(packing.text_index))]
    singles = transformer.single_transformer_blocks
    for i, block in enumerate(singles):
        swaps += [norm_swaps(block.norm, all_rows, packing, len(packing.text_index)),
                  (singles, str(i), RowsSingleBlock(block))]
    with (swapped(transformer, PackedFluxAttnProcessor(packing), FluxAttnProcessor, swaps),
          cached_blocks(transformer, token_pass(cache, packing), "token", packing)):
        out = transformer(
            hidden_states=packing.pack([x.flatten(1).T for x in samples])[:, None],
            timestep=timestep,
            guidance=guidance,
            pooled_projections=pooled_projections,
            encoder_hidden_states=packing.text(encoder_hidden_states),
            txt_ids=txt_ids,
            img_ids=txt_ids.new_zeros(1, 3),  # PackedRotary makes every image's own ids
            return_dict=False,
        )[0]  # [S_img, 1, C]
    return [own_grid(part[:, 0], shape) for part, shape in zip(packing.unpack(out), shapes)]


def own_grid(tokens: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An image's output [tokens, C] of a layout as its own grid [C, h, w] (a reference's dropped)."""
    h, w = shape[-2:]
    return tokens[: h * w].T.reshape(-1, h, w)
