"""Packed inference for Wan (`WanTransformer3DModel`): clips of different lengths and sizes in ONE
forward, every token computed once (`pack_dit` has the packing the DiTs share).

The model runs unchanged on a batch whose rows are tokens: each clip's 1x2x2 latent patches, in
the order the model flattens them (frames, then rows, then columns), are the rows of one
`[S, C, 1, 2, 2]` input, so its patch embedding, every per-token layer and its un-patchify are
right as they are. Three things see more than one row, and are put right from the outside for the
duration of the forward:

- conditioning: each clip's time embedding and its six modulations are computed once from the
  clip's own timestep and given to each of its tokens (`PackedConditions`), so clips at different
  steps share the forward;
- position: the model's RoPE is read off its input's shape; `PackedRotary` makes each clip
  shape's own 3D RoPE (frames, rows, columns) instead;
- attention: self-attention within each clip (clips of one shape in one call), cross-attention
  of each clip's tokens to its own 512 text rows, and an image-to-video clip's to its own image
  states too (`PackedWanAttnProcessor`).

Under the block cache the units are tokens (`token_rows`): a block runs on the tokens whose input
changed, each clip's self-attention taking the others' keys and values from the cache's
activations (`Packing.subset`, as the DiT packing does).

Clips all of one shape need no packing: they run as the model's own batch (unless `whole_batches`
is False: benchmarks timing the packing itself).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch import nn

from gouache.attention import attend_each, split_heads
from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.runner.pack_dit import Packing, row_cuts, swapped, token_pass


class PackedRotary(nn.Module):
    """Stands in for WanRotaryPosEmbed: the RoPE (cos, sin) [tokens, d] of each clip shape of the
    packing, in group order, as the model makes it for a clip of that shape alone."""

    def __init__(self, rope: nn.Module, packing: Packing):
        super().__init__()
        self.rope, self.packing = rope, packing

    def forward(self, hidden_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        p_t, p_h, p_w = self.rope.patch_size
        out = []
        for group in self.packing.groups:
            frames, height, width = group.shape
            shaped = hidden_states.new_empty(1, 0, frames * p_t, height * p_h, width * p_w)  # its shape is all it reads
            out.append(tuple(x[0, :, 0] for x in self.rope(shaped)))
        return out


class PackedConditions(nn.Module):
    """Stands in for WanTimeTextImageEmbedding: the embedding of each clip's timestep (one row per
    clip), given to each of its tokens (`index`: the clip of each token row)."""

    def __init__(self, embedder: nn.Module, index: torch.Tensor):
        super().__init__()
        self.embedder, self.index = embedder, index

    def forward(self, timestep, encoder_hidden_states, encoder_hidden_states_image=None, timestep_seq_len=None):
        temb, projected, text, image = self.embedder(timestep, encoder_hidden_states, encoder_hidden_states_image,
                                                     timestep_seq_len)
        return temb.index_select(0, self.index), projected.index_select(0, self.index), text, image


class PackedWanAttnProcessor:
    """WanAttnProcessor over packed rows [S, 1, D]: self-attention within each clip, cross-attention
    of each clip's tokens to its own text (`encoder_hidden_states` [clips, L, D] in caller order,
    as every other per-clip input: a LoRA's rows are told apart by it); in an image-to-video
    model, the rows before the text's last `text_length` are the clip's image states, attended
    through the layer's own projections (add_k_proj, add_v_proj) and added."""

    def __init__(self, packing: Packing, text_length: int):
        self.packing, self.text_length = packing, text_length

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is not None or attn.fused_projections:
            raise NotImplementedError("packed Wan attention takes no mask or fused projections")
        rows = hidden_states[:, 0]  # every token's, or under the block cache the computed ones' (`subset`)
        query = split_heads(attn, attn.norm_q(attn.to_q(rows)))
        if encoder_hidden_states is None:
            key, value = self.self_kv(attn, rows)
            out, _ = self.packing.attend((query, key, value), None, text_first=False, rope=rotary_emb)
            return attn.to_out[1](attn.to_out[0](out.type_as(query)[:, None]))
        image, text = encoder_hidden_states.split(
            [encoder_hidden_states.shape[1] - self.text_length, self.text_length], dim=1)
        key = split_heads(attn, attn.norm_k(attn.to_k(text)))
        out = self.cross(query, key, split_heads(attn, attn.to_v(text))).type_as(query)
        if attn.add_k_proj is not None:
            key = split_heads(attn, attn.norm_added_k(attn.add_k_proj(image)))
            out = out + self.cross(query, key, split_heads(attn, attn.add_v_proj(image))).type_as(query)
        return attn.to_out[1](attn.to_out[0](out[:, None]))

    def self_kv(self, attn, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [S, H, d] of every token: under the block cache, those of the reused
        ones from its activations (their attention's input as last computed, or their keys and
        values)."""
        subset = self.packing.subset
        if subset is not None and not subset.caches_kv:
            rows = subset.full(attn, rows)
        key, value = split_heads(attn, attn.norm_k(attn.to_k(rows))), split_heads(attn, attn.to_v(rows))
        return subset.kv(attn, key, value) if subset is not None and subset.caches_kv else (key, value)

    def cross(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Each clip's queries [tokens, H, d] over its own text's keys and values [L, H, d] (clips
        of one shape in one call; under the block cache, each clip's computed tokens) -> [rows, H * d]."""
        computed = None if self.packing.subset is None else self.packing.subset.computed
        if computed is not None:
            cuts = row_cuts(computed, self.packing.bounds(text=False))
            clips = self.packing.positions.tolist()
            calls = [(query[a:b], key[c], value[c]) for c, a, b in zip(clips, cuts, cuts[1:]) if b > a]
            return torch.cat(attend_each(calls)) if calls else query.new_empty(0, query.shape[1] * query.shape[2])
        out, first = [], 0
        for group in self.packing.groups:
            clips = self.packing.positions[first:first + group.count]  # their caller indices
            q = query[group.image_rows].unflatten(0, (group.count, -1))
            out.append(dispatch_attention_fn(q, key[clips], value[clips]).flatten(2).flatten(0, 1))
            first += group.count
        return out[0] if len(out) == 1 else torch.cat(out)


def packed_wan_forward(transformer: nn.Module, samples: list[torch.Tensor], timestep: torch.Tensor,
                       encoder_hidden_states: torch.Tensor, whole_batches: bool = True,
                       cache: CachedForward | None = None,
                       encoder_hidden_states_image: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Wan's transformer over clips of mixed lengths and sizes in one forward.

    samples: per row (caller order) its input [C, F, H, W]; timestep [rows]; encoder_hidden_states
    [rows, L, D]; an image-to-video model's encoder_hidden_states_image [rows, I, D']. Returns each
    row's prediction [C_out, F, H, W], equal to its own forward's. With a `cache`, blocks reuse
    cached outputs per clip (one shape: the model's own batch) or per token."""
    p_t, p_h, p_w = transformer.config.patch_size
    shapes = [(f // p_t, h // p_h, w // p_w) for f, h, w in (x.shape[1:] for x in samples)]
    inputs = {"timestep": timestep, "encoder_hidden_states": encoder_hidden_states,
              "encoder_hidden_states_image": encoder_hidden_states_image, "return_dict": False}
    if whole_batches and len(set(shapes)) == 1:
        with cached_blocks(transformer, cache and cache.begin()):
            return list(transformer(hidden_states=torch.stack(samples), **inputs)[0])
    packing = Packing.build(shapes, 0, samples[0].device)  # the text is no row: it enters by cross-attention
    swaps = [(transformer, "rope", PackedRotary(transformer.rope, packing)),
             (transformer, "condition_embedder", PackedConditions(transformer.condition_embedder,
                                                                  packing.image_index))]
    tokens = packing.pack([patches(x, (p_t, p_h, p_w)) for x in samples])
    processor = PackedWanAttnProcessor(packing, encoder_hidden_states.shape[1])
    with (swapped(transformer, processor, WanAttnProcessor, swaps),
          cached_blocks(transformer, token_pass(cache, packing), "token_rows", packing)):
        out = transformer(hidden_states=tokens, **inputs)[0]
    return [unpatch(part, shape) for part, shape in zip(packing.unpack(out), shapes)]


def patches(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """A clip's latents [C, F, H, W] as its tokens' patches [tokens, C, p_t, p_h, p_w], in the
    order the model flattens its patch embedding (frames, rows, columns)."""
    channels, frames, height, width = latents.shape
    p_t, p_h, p_w = patch
    grid = latents.reshape(channels, frames // p_t, p_t, height // p_h, p_h, width // p_w, p_w)
    return grid.permute(1, 3, 5, 0, 2, 4, 6).reshape(-1, channels, p_t, p_h, p_w)


def unpatch(tokens: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """`patches`' inverse: a clip's tokens [tokens, C, p_t, p_h, p_w] of a token grid `shape` -> [C, F, H, W]."""
    channels, p_t, p_h, p_w = tokens.shape[1:]
    frames, height, width = shape
    grid = tokens.reshape(frames, height, width, channels, p_t, p_h, p_w).permute(3, 0, 4, 1, 5, 2, 6)
    return grid.reshape(channels, frames * p_t, height * p_h, width * p_w)
