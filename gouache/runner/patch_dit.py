"""Patched inference for DiTs (SD3's MMDiT, Flux): images of different sizes in ONE forward.

Every image is cut into square patches (`PatchLayout`) and the patches form the batch, so the
per-token work (linears, norms, AdaLN modulation, FFNs) runs once over all of them. Two things
need the whole image, and are restored from the outside while the model runs unchanged:

- position: a patch's tokens get the positional embedding (SD3) or RoPE ids (Flux) of their
  place in the IMAGE, never of their place in the patch;
- joint attention: each image attends over [its text tokens once + all its patches' tokens].
  Patches of one image and images of one resolution are contiguous, so an image's tokens are
  a reshape of its patches' tokens (patch-major, which attention does not care about: queries
  map row by row and keys/values are summed over).

Every patch carries a copy of its image's text tokens through the context stream, because
the diffusers blocks run the text stream per batch row. The processors read the text of the
image's FIRST patch only and write the one result back to every copy, so all copies stay
equal; the context-stream work (AdaLN, FFN, projections) on the other copies is redundant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from diffusers import FluxPipeline
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import nn

from gouache.runner.layout import PatchLayout

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # each [batch, tokens, heads, head_dim]


# ------------------------------------------------------------------------------ image groups


@dataclass(frozen=True)
class ImageGroups:
    """Index views of a PatchLayout that the patched processors need, on the model's device."""

    patches: tuple[slice, ...]  # per resolution group: its patches (layout order)
    images: tuple[slice, ...]  # per resolution group: its images (layout positions)
    first: torch.Tensor  # [num_images] first patch of each image: where its text copy is read
    patch_image: torch.Tensor  # [num_patches] layout position of each patch's image: where text is written

    @classmethod
    def build(cls, layout: PatchLayout, device: torch.device) -> ImageGroups:
        offsets = layout.request_offsets
        images = tuple(slice(start, start + count) for start, count, _ in layout.groups)
        return cls(
            patches=tuple(slice(offsets[s.start], offsets[s.stop]) for s in images),
            images=images,
            first=torch.tensor(offsets[:-1], device=device),
            patch_image=torch.tensor(layout.patch_image, device=device),
        )

    def attend(self, image: QKV, text: QKV | None, text_first: bool, rope: list | None = None):
        """Joint attention per image. image: [num_patches, T, H, d] each; text: [num_images, L, H, d]
        each (one copy per image) -> ([num_patches, T, H*d], [num_images, L, H*d] or None)."""
        text_len = 0 if text is None else text[0].shape[1]
        image_out, text_out = [], []
        for group, (patches, images) in enumerate(zip(self.patches, self.images)):
            count = images.stop - images.start
            # [count * per, T, H, d] -> [count, per * T, H, d]: a reshape, patches are contiguous
            qkv = [x[patches].reshape(count, -1, *x.shape[2:]) for x in image]
            if text is not None:  # in the model's own token order: Flux puts text first, SD3 last
                qkv = [torch.cat([t[images], x] if text_first else [x, t[images]], dim=1) for t, x in zip(text, qkv)]
            if rope is not None:
                qkv[:2] = [apply_rotary_emb(x, rope[group], sequence_dim=1) for x in qkv[:2]]
            out = dispatch_attention_fn(*qkv).flatten(2)  # [count, S, H * d]
            sizes = [text_len, out.shape[1] - text_len]
            text_part, image_part = out.split(sizes, 1) if text_first else out.split(sizes[::-1], 1)[::-1]
            text_out.append(text_part)
            image_out.append(image_part.reshape(-1, image[0].shape[1], out.shape[-1]))
        return torch.cat(image_out), (torch.cat(text_out) if text is not None else None)


def project(x: torch.Tensor, heads: int, projections, norms) -> QKV:
    """q, k, v of tokens x [B, S, D] as [B, S, heads, d], with the model's optional qk norms."""
    out = []
    for proj, norm in zip(projections, (*norms, None)):  # v is never normed
        y = proj(x).unflatten(-1, (heads, -1))
        out.append(y if norm is None else norm(y))
    return tuple(out)


def patch_tokens(grid: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, h, w] per-position values of one image -> [num_patches, patch * patch, C], each
    patch's tokens in raster order, exactly as the patched forward lays its tokens out."""
    return PatchLayout.build([tuple(grid.shape[1:])], patch).split([grid]).flatten(2).transpose(1, 2)


def per_patch(layout: PatchLayout, values: torch.Tensor) -> torch.Tensor:
    """[num_images, ...] in caller order -> [num_patches, ...]: each patch gets its image's row."""
    index = [layout.order[position] for position in layout.patch_image]
    return values[torch.tensor(index, device=values.device)]


@contextlib.contextmanager
def installed(transformer: nn.Module, processor, expected: type, modules: dict[str, nn.Module]) -> Iterator[None]:
    """Set `processor` on every attention and swap `modules` in; put the originals back after."""
    saved = transformer.attn_processors
    for name, original in saved.items():
        # any other processor (IP-Adapter, fused qkv, PAG) does work this one would silently drop
        if type(original) is not expected:
            raise ValueError(f"patched inference supports {expected.__name__} only; {name} is {type(original).__name__}")
    originals = {name: getattr(transformer, name) for name in modules}
    try:
        transformer.set_attn_processor(processor)
        for name, module in modules.items():
            setattr(transformer, name, module)
        yield
    finally:
        for name, module in originals.items():
            setattr(transformer, name, module)
        transformer.set_attn_processor(dict(saved))  # a copy: diffusers pops from the dict


# ------------------------------------------------------------------------------------- SD3


class ImagePosPatchEmbed(nn.Module):
    """Stands in for SD3's PatchEmbed: same projection, but each patch adds its slice of the
    cropped sincos embedding the unpatched model would add for its whole image."""

    def __init__(self, embed: nn.Module, layout: PatchLayout):
        super().__init__()
        if not embed.pos_embed_max_size:
            raise ValueError("patched SD3 needs the cropped pos-embed (pos_embed_max_size set)")
        self.embed = embed
        self.register_buffer("pos", self.layout_pos_embed(embed, layout), persistent=False)

    @staticmethod
    def layout_pos_embed(embed: nn.Module, layout: PatchLayout) -> torch.Tensor:
        """[num_patches, tokens per patch, D] in layout order."""
        size, parts = embed.patch_size, []
        for start, count, _ in layout.groups:
            h, w = layout.shape_at(start)
            full = embed.cropped_pos_embed(h, w)[0]  # [(h/size) * (w/size), D], raster order
            grid = full.T.reshape(-1, h // size, w // size)
            parts.append(patch_tokens(grid, layout.patch // size).repeat(count, 1, 1))
        return torch.cat(parts)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        x = self.embed.proj(latent).flatten(2).transpose(1, 2)  # [N, C, p, p] -> [N, T, D]
        if self.embed.layer_norm:
            x = self.embed.norm(x)
        return (x + self.pos).to(x.dtype)


class PatchedJointAttnProcessor:
    """JointAttnProcessor2_0 over whole images for a batch of patches (also serves SD3.5's
    image-only `attn2`, called without text)."""

    def __init__(self, groups: ImageGroups):
        self.groups = groups

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        g = self.groups
        image = project(hidden_states, attn.heads, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        text = None
        if encoder_hidden_states is not None:
            copies = encoder_hidden_states[g.first]
            added = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text = project(copies, attn.heads, added, (attn.norm_added_q, attn.norm_added_k))
        image_out, text_out = g.attend(image, text, text_first=False)
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        if text is None:
            return image_out
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out[g.patch_image]


@contextlib.contextmanager
def sd3_patching(transformer: nn.Module, layout: PatchLayout) -> Iterator[None]:
    """While inside, `transformer` takes the layout's patches [num_patches, C, p, p] as its batch."""
    groups = ImageGroups.build(layout, transformer.device)
    embed = ImagePosPatchEmbed(transformer.pos_embed, layout)
    with installed(transformer, PatchedJointAttnProcessor(groups), JointAttnProcessor2_0, {"pos_embed": embed}):
        yield


def patched_sd3_forward(
    transformer: nn.Module,
    layout: PatchLayout,
    samples: list[torch.Tensor],
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pooled_projections: torch.Tensor,
) -> list[torch.Tensor]:
    """SD3 transformer over images of mixed sizes in one forward.

    samples: [C, h, w] latents (caller order); timestep [num_images]; encoder_hidden_states
    [num_images, L, D]; pooled_projections [num_images, D']. Returns [C_out, h, w] per image,
    equal to the unpatched forward of each image alone.
    """
    if layout.patch % transformer.config.patch_size:
        raise ValueError(f"patch {layout.patch} is not a multiple of the DiT patch size {transformer.config.patch_size}")
    with sd3_patching(transformer, layout):
        out = transformer(
            hidden_states=layout.split(samples),
            timestep=per_patch(layout, timestep),
            encoder_hidden_states=per_patch(layout, encoder_hidden_states),
            pooled_projections=per_patch(layout, pooled_projections),
            return_dict=False,
        )[0]
    return layout.merge(out)


# ------------------------------------------------------------------------------------ Flux


class ImageRotary(nn.Module):
    """Stands in for FluxPosEmbed: per resolution group, the RoPE of [text, every image token
    in patch-major order] with each token's id taken from its place in the whole image."""

    def __init__(self, rope: nn.Module, layout: PatchLayout):
        super().__init__()
        self.rope = rope
        self.tokens_per_patch = layout.patch**2
        self.image_ids = [self.group_ids(layout, start) for start, _, _ in layout.groups]

    @staticmethod
    def group_ids(layout: PatchLayout, start: int) -> torch.Tensor:
        """[patches per image * tokens per patch, 3]: the pipeline's ids, cut like the tokens."""
        h, w = layout.shape_at(start)
        ids = FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32)  # [h * w, 3]
        return patch_tokens(ids.T.reshape(3, h, w), layout.patch).reshape(-1, 3)

    def forward(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        txt_ids = ids[: len(ids) - self.tokens_per_patch]  # the model appends one patch's img_ids
        return [self.rope(torch.cat([txt_ids, img.to(ids)])) for img in self.image_ids]


class PatchedFluxAttnProcessor:
    """FluxAttnProcessor over whole images for a batch of patches, in both block kinds."""

    def __init__(self, groups: ImageGroups, tokens_per_patch: int):
        self.groups = groups
        self.tokens_per_patch = tokens_per_patch

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:  # Flux pipelines pass none; a padded-text mask would need per-image work
            raise NotImplementedError("patched Flux attention takes no attention mask")
        g, norms = self.groups, (attn.norm_q, attn.norm_k)
        own = (attn.to_q, attn.to_k, attn.to_v)
        if encoder_hidden_states is None:  # single-stream: a patch's tokens are [text copy, image]
            length = hidden_states.shape[1] - self.tokens_per_patch
            text = project(hidden_states[g.first, :length], attn.heads, own, norms)
            hidden_states = hidden_states[:, length:]
        else:
            added = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text = project(encoder_hidden_states[g.first], attn.heads, added, (attn.norm_added_q, attn.norm_added_k))
        image = project(hidden_states, attn.heads, own, norms)
        image_out, text_out = g.attend(image, text, text_first=True, rope=image_rotary_emb)
        if encoder_hidden_states is None:
            return torch.cat([text_out[g.patch_image], image_out], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        return image_out, attn.to_add_out(text_out)[g.patch_image]


@contextlib.contextmanager
def flux_patching(transformer: nn.Module, layout: PatchLayout) -> Iterator[None]:
    """While inside, `transformer` takes the layout's patches as [num_patches, p * p, C] tokens."""
    if transformer.config.patch_size != 1:
        raise ValueError("patched Flux expects packed latents (transformer patch_size 1)")
    groups = ImageGroups.build(layout, transformer.device)
    processor = PatchedFluxAttnProcessor(groups, layout.patch**2)
    with installed(transformer, processor, FluxAttnProcessor, {"pos_embed": ImageRotary(transformer.pos_embed, layout)}):
        yield


def patched_flux_forward(
    transformer: nn.Module,
    layout: PatchLayout,
    samples: list[torch.Tensor],
    timestep: torch.Tensor,
    guidance: torch.Tensor | None,
    pooled_projections: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    txt_ids: torch.Tensor,
) -> list[torch.Tensor]:
    """Flux transformer over images of mixed sizes in one forward.

    samples: [C_packed, h_tok, w_tok] token grids (caller order; the layout is built on token
    grid shapes); timestep [num_images] (already /1000); guidance [num_images] or None;
    pooled_projections [num_images, D']; encoder_hidden_states [num_images, L, D]; txt_ids
    [L, 3]. Returns [C_packed, h_tok, w_tok] per image, equal to each image's unpatched forward.
    """
    patches = layout.split(samples)  # [N, C, p, p]
    n, c, p, _ = patches.shape
    with flux_patching(transformer, layout):
        out = transformer(
            hidden_states=patches.flatten(2).transpose(1, 2),
            timestep=per_patch(layout, timestep),
            guidance=None if guidance is None else per_patch(layout, guidance),
            pooled_projections=per_patch(layout, pooled_projections),
            encoder_hidden_states=per_patch(layout, encoder_hidden_states),
            txt_ids=txt_ids,
            # only its length matters: ImageRotary supplies every token's real image id
            img_ids=txt_ids.new_zeros(p * p, 3),
            return_dict=False,
        )[0]
    return layout.merge(out.transpose(1, 2).reshape(n, -1, p, p))
