"""Mask-aware edits in a UNet (SD, SDXL): the transformer blocks compute masked tokens only.

InstGenIE's SDXL case. In each `BasicTransformerBlock` (the self-attention, cross-attention
and feed-forward of a UNet's `Transformer2DModel`), an edit that replays a template runs its
masked tokens only: the block gets them packed image by image as one row `[1, N, C]`, its
self-attention takes their queries with the keys and values of every token of their image
(the others' from the template), its cross-attention each image's own text, and the
unmasked tokens' outputs come from the template. Everything else (resnets, GroupNorms,
convolutions, up/downsampling, the Transformer2DModels' projections in and out) runs on every
token: the share of the UNet's work this saves is the blocks' (`gouache bench edit` reports it).

A level of the UNet has its own token grid (the latent's, halved per downsampling); an edit's
mask there is its latent mask max-pooled to that grid, so a token is computed wherever any of
its latent pixels is. Each level gets a `TemplatePass` of its own over the same images, entries
and recordings (`replay`).

Under `--compile` a replay that records nothing and computes every block the same way (no load
plan that runs some blocks in full) runs compiled, its layout as data (`ReplayLayout`: per
grid, the computed tokens; per block, the template's activations of every token, which the
computed ones overwrite), so one graph serves every mask (`gouache.runner.compiled`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from gouache.attention import attend_each, attend_segments, check_plain
from gouache.templates.replay import ReplayForward, TemplatePass


@functools.lru_cache(maxsize=16)
def unet_template_blocks(unet: nn.Module) -> tuple[tuple[nn.Module, str, str], ...]:
    """(parent, attribute, key) of every transformer block of the UNet, in forward order; found
    once per model (walking its modules costs a millisecond, every forward needs them)."""
    return tuple((module.transformer_blocks, str(i), f"{name}.transformer_blocks.{i}")
                 for name, module in unet.named_modules() if isinstance(module, Transformer2DModel)
                 for i in range(len(module.transformer_blocks)))


class UNetTemplatePass:
    """One UNet forward's template reuse: a `TemplatePass` per token grid, made when first met."""

    def __init__(self, replay: ReplayForward, latent_hw: tuple[int, int]):
        self.replay, self.latent_hw = replay, latent_hw
        self._levels: dict[int, TemplatePass] = {}
        self._masks: dict[int, tuple[torch.Tensor | None, ...]] = {}

    def level(self, tokens: int) -> TemplatePass:
        """The pass over images of `tokens` tokens each (one grid of the UNet)."""
        if tokens not in self._levels:
            images = [replace(image, tokens=tokens, computed=computed)
                      for image, computed in zip(self.replay.images, self.computed(tokens))]
            self._levels[tokens] = TemplatePass(self.replay, images)
        return self._levels[tokens]

    def computed(self, tokens: int) -> list[torch.Tensor | None]:
        """Per image, the tokens it computes on the grid of `tokens` tokens (None: all)."""
        factor = self._factor(tokens)
        return [self._pooled(image.computed, factor) for image in self.replay.images]

    def _factor(self, tokens: int) -> int:
        h, w = self.latent_hw
        factor = 1
        while math.ceil(h / factor) * math.ceil(w / factor) != tokens:
            factor *= 2
            if factor > max(h, w):
                raise ValueError(f"no level of a {h}x{w} latent has {tokens} tokens")
        return factor

    def _pooled(self, computed: torch.Tensor | None, factor: int) -> torch.Tensor | None:
        """Latent-pixel indices -> indices at the grid `factor` times coarser (a token is computed
        if any of its pixels is)."""
        if computed is None or factor == 1:
            return computed
        h, w = self.latent_hw
        grid = torch.zeros(h * w, device=computed.device)
        grid[computed] = 1
        pooled = F.max_pool2d(grid.view(1, 1, h, w), factor, ceil_mode=True)
        return pooled.flatten().nonzero().squeeze(1)

    def end(self) -> None:
        self.replay.cache.finish(self.replay.recordings, self.replay.blocks)


class MaskedTransformerBlock(nn.Module):
    """Runs a BasicTransformerBlock on the tokens its level's pass computes."""

    def __init__(self, inner: nn.Module, key: str, unet_pass: UNetTemplatePass):
        super().__init__()
        _check_block(inner)
        self.inner, self.key, self.unet_pass = inner, key, unet_pass

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
        if attention_mask is not None or encoder_attention_mask is not None:
            raise NotImplementedError("mask-aware UNet edits take no attention mask")
        batch, tokens = hidden_states.shape[:2]
        level = self.unet_pass.level(tokens)
        units = hidden_states.flatten(0, 1)  # [B * S, C]: image-major, as the pass counts tokens
        computed = level.select(self.key, units)
        rows = units if computed is None else units.index_select(0, computed)
        processor = RowsAttnProcessor(level, computed, batch, tokens)
        attentions = [self.inner.attn1] + ([self.inner.attn2] if self.inner.attn2 is not None else [])
        with _processors(attentions, processor):
            out = self.inner(rows[None], encoder_hidden_states=encoder_hidden_states,
                             cross_attention_kwargs=cross_attention_kwargs)[0]
        return level.merge(self.key, units, computed, [out])[0].unflatten(0, (batch, tokens))


def _check_block(block: nn.Module) -> None:
    if block.norm_type != "layer_norm" or block.pos_embed is not None or block.only_cross_attention:
        raise ValueError("mask-aware UNet edits support layer-norm transformer blocks with self-attention")


def replayable(unet: nn.Module) -> bool:
    """Whether every transformer block of `unet` takes a mask-aware edit."""
    try:
        for parent, name, _ in unet_template_blocks(unet):
            block = getattr(parent, name)
            _check_block(block)
            for attn in (block.attn1, block.attn2):
                if attn is not None:
                    check_plain(attn)
    except ValueError:
        return False
    return True


class RowsAttnProcessor:
    """AttnProcessor2_0 over one row of computed tokens, image by image: self-attention over
    every token of the image (the others' keys and values from the pass), cross-attention over
    the image's own text."""

    def __init__(self, level: TemplatePass, computed: torch.Tensor | None, batch: int, tokens: int):
        self.level, self.computed, self.batch, self.tokens = level, computed, batch, tokens

    def _cuts(self, device: torch.device) -> list[int]:
        """Where each image's rows start among the computed rows (and where the last ends)."""
        bounds = torch.arange(self.batch + 1, device=device) * self.tokens
        if self.computed is None:
            return bounds.tolist()
        return torch.searchsorted(self.computed, bounds).tolist()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        rows = hidden_states[0]  # [N, C]
        q = attn.to_q(rows)
        if encoder_hidden_states is None:  # self-attention: keys and values of every token
            k, v = self.level.kv(attn, attn.to_k(rows), attn.to_v(rows), self.computed)
            keys = [(k[b * self.tokens:(b + 1) * self.tokens], v[b * self.tokens:(b + 1) * self.tokens])
                    for b in range(self.batch)]
        else:
            keys = list(zip(attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)))
        cuts, heads = self._cuts(rows.device), attn.heads
        calls = [tuple(x.unflatten(-1, (heads, -1)) for x in (q[cuts[b]:cuts[b + 1]], kb, vb))  # [S, H, d]
                 for b, (kb, vb) in enumerate(keys)]
        out = torch.cat(attend_each(calls))
        return attn.to_out[1](attn.to_out[0](out))[None] / attn.rescale_output_factor


@contextlib.contextmanager
def _processors(attentions: list[nn.Module], processor) -> Iterator[None]:
    saved = [attn.processor for attn in attentions]
    for attn in attentions:
        check_plain(attn)
    try:
        for attn in attentions:
            attn.set_processor(processor)
        yield
    finally:
        for attn, original in zip(attentions, saved):
            attn.set_processor(original)


@contextlib.contextmanager
def masked_blocks(unet: nn.Module, replay: ReplayForward, latent_hw: tuple[int, int]) -> Iterator[None]:
    """Wrap the UNet's transformer blocks for one forward of `replay`; restore them after and
    store what the forward recorded."""
    unet_pass = UNetTemplatePass(replay, latent_hw)
    slots = unet_template_blocks(unet)
    originals = [getattr(parent, name) for parent, name, _ in slots]
    try:
        for (parent, name, key), block in zip(slots, originals):
            setattr(parent, name, MaskedTransformerBlock(block, key, unet_pass))
        yield
    finally:
        for (parent, name, _), block in zip(slots, originals):
            setattr(parent, name, block)
        unet_pass.end()


# ------------------------------------------------------------------------- the layout as data


@dataclass
class ReplayLayout:
    """A UNet replay's layout as tensors (a compiled forward's inputs besides the UNet's):
    `computed[S]`: on the grid of S tokens an image, the computed tokens' indices among the
    batch's (image-major, ascending), every token of an image that replays nothing;
    `template[key]`: the block's output, its self-attention's keys and values, [images, S, C]
    each, from the images' templates (zeros for an image that replays nothing: all computed).
    Its shapes depend on the batch and the computed counts only, never on which tokens."""

    computed: dict[int, torch.Tensor]
    template: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def replay_layout(unet: nn.Module, replay: ReplayForward, latent_hw: tuple[int, int],
                  dtype: torch.dtype) -> tuple[ReplayLayout | None, str | None]:
    """`replay` as a `ReplayLayout`, or None and why it runs eagerly: a recorder in the forward
    (its activations are recorded block by block), or a load plan that computes some blocks in
    full (they differ from the others)."""
    if replay.recordings:
        return None, "template recording"
    if any(image.full_blocks for image in replay.images):
        return None, "template load plan"
    grids = block_grids(unet, latent_hw)
    device = next(unet.parameters()).device
    # the grids' computed tokens, with no `TemplatePass` made: the eager pass names the attentions
    # it records as it finds them inside its wrappers (`recorded_kv`), and it alone may name them
    unet_pass = UNetTemplatePass(replay, latent_hw)
    computed = {tokens: torch.cat([b * tokens + (torch.arange(tokens, device=device) if local is None
                                                 else local.to(device))
                                   for b, local in enumerate(unet_pass.computed(tokens))])
                for tokens in sorted(set(grids.values()))}
    template = {}
    for key in grids:
        parts = []
        for name in (key, *recorded_kv(key)):
            like = next(image.entry[name][image.row] for image in replay.images if image.entry is not None)
            parts.append(torch.stack([(image.entry[name][image.row] if image.entry is not None
                                       else torch.zeros_like(like)).to(device, dtype) for image in replay.images]))
        template[key] = tuple(parts)
    counts = replay.cache.counts
    for tokens in grids.values():
        counts.computed_tokens += len(computed[tokens])
        counts.replayed_tokens += len(replay.images) * tokens - len(computed[tokens])
    return ReplayLayout(computed, template), None


def recorded_kv(key: str) -> tuple[str, str]:
    """The names a recording gives a block's self-attention keys and values: the eager pass
    names attentions as it finds them, inside the blocks' `MaskedTransformerBlock` (`inner`)."""
    return f"{key}.inner.attn1.k", f"{key}.inner.attn1.v"


def example_layout(unet: nn.Module, images: int, latent_hw: tuple[int, int], dtype: torch.dtype,
                   share: float = 0.25) -> ReplayLayout:
    """A layout of `images` images each computing the first `share` of its tokens on every
    grid (two at least), its template zeros: the shapes the warm-up compiles a replay at."""
    device = next(unet.parameters()).device
    grids = block_grids(unet, latent_hw)
    computed = {tokens: torch.cat([b * tokens + torch.arange(min(tokens, max(2, int(tokens * share))),
                                                                   device=device)
                                   for b in range(images)]) for tokens in set(grids.values())}
    template = {}
    for parent, name, key in unet_template_blocks(unet):
        block = getattr(parent, name)
        widths = (block.norm1.normalized_shape[0], block.attn1.to_k.out_features, block.attn1.to_v.out_features)
        template[key] = tuple(torch.zeros(images, grids[key], c, device=device, dtype=dtype) for c in widths)
    return ReplayLayout(computed, template)


def block_grids(unet: nn.Module, latent_hw: tuple[int, int]) -> dict[str, int]:
    """Per transformer block key, the tokens of its grid for a latent of `latent_hw`: a down
    block's level halves the latent (rounding up) once per block before it, the middle block
    is at the last down block's level, an up block's level doubles back."""
    down, grids = len(unet.down_blocks), {}
    for _, _, key in unet_template_blocks(unet):
        part, index = key.split(".")[:2]
        if part == "down_blocks":
            level = int(index)
        elif part == "mid_block":
            level = down - 1
        else:
            level = down - 1 - int(index)
        grids[key] = math.ceil(latent_hw[0] / 2 ** level) * math.ceil(latent_hw[1] / 2 ** level)
    return grids


class ReplayedBlock(nn.Module):
    """A BasicTransformerBlock on its grid's computed tokens, the layout read as tensors
    (`ReplayLayout`): the others' outputs are the template's."""

    def __init__(self, inner: nn.Module, key: str, layout: ReplayLayout):
        super().__init__()
        _check_block(inner)
        self.inner, self.key, self.layout = inner, key, layout

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
        batch, tokens = hidden_states.shape[:2]
        computed = self.layout.computed[tokens]
        rows = hidden_states.flatten(0, 1).index_select(0, computed)
        out = self.inner(rows[None], encoder_hidden_states=encoder_hidden_states,
                         cross_attention_kwargs=cross_attention_kwargs)[0]
        template = self.layout.template[self.key][0].flatten(0, 1)
        return template.index_copy(0, computed, out).unflatten(0, (batch, tokens))


class ReplayedAttnProcessor:
    """`RowsAttnProcessor` with the layout as data: the computed queries of each image over
    every token of it (self-attention: its keys and values from the template but for the
    computed ones) or over its own text, one `attend_segments` call whose cuts are tensors."""

    def __init__(self, layout: ReplayLayout, key: str):
        self.layout, self.key = layout, key

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        rows = hidden_states[0]  # [N, C]
        _, k_template, v_template = self.layout.template[self.key]
        batch, tokens = k_template.shape[:2]
        computed = self.layout.computed[tokens]
        images = torch.arange(batch + 1, device=rows.device)
        q_cuts = torch.searchsorted(computed, images * tokens)
        if encoder_hidden_states is None:
            k = k_template.flatten(0, 1).index_copy(0, computed, attn.to_k(rows))
            v = v_template.flatten(0, 1).index_copy(0, computed, attn.to_v(rows))
            kv_cuts = images * tokens
        else:
            k, v = (proj(encoder_hidden_states).flatten(0, 1) for proj in (attn.to_k, attn.to_v))
            kv_cuts = images * encoder_hidden_states.shape[1]
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in (attn.to_q(rows), k, v))
        out = attend_segments(q, k, v, q_cuts, kv_cuts)
        return attn.to_out[1](attn.to_out[0](out))[None] / attn.rescale_output_factor


@contextlib.contextmanager
def replayed_blocks(unet: nn.Module, layout: ReplayLayout) -> Iterator[None]:
    """Wrap the UNet's transformer blocks to run `layout`'s computed tokens (its attentions'
    processors too, before the forward: a compiled graph traces them as they are); restore
    them after."""
    slots = unet_template_blocks(unet)
    originals = [getattr(parent, name) for parent, name, _ in slots]
    attentions = [(attn, key) for block, (_, _, key) in zip(originals, slots)
                  for attn in (block.attn1, block.attn2) if attn is not None]
    for attn, _ in attentions:
        check_plain(attn)
    saved = [attn.processor for attn, _ in attentions]
    try:
        for attn, key in attentions:
            attn.set_processor(ReplayedAttnProcessor(layout, key))
        for (parent, name, key), block in zip(slots, originals):
            setattr(parent, name, ReplayedBlock(block, key, layout))
        yield
    finally:
        for (parent, name, _), block in zip(slots, originals):
            setattr(parent, name, block)
        for (attn, _), processor in zip(attentions, saved):
            attn.set_processor(processor)
