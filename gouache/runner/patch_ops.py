"""Patch-aware operators: run one diffusers UNet forward over a mixed-resolution patch batch.

PatchedServe §4.2. The batch is `[num_patches, C, s, s]` in `PatchLayout` order. Pixel-wise
operators (linear, 1x1 convs, feed-forward, nearest upsampling, time embeddings) are exact per
patch and left alone. Three kinds need the rest of the image:

- convolutions with kernel > 1 read their neighbours' border pixels (halo stitching);
- GroupNorm takes its statistics over every patch of an image;
- self-attention regathers each image's tokens; images of one resolution are contiguous, so
  that is a reshape `[k * P, T, C] -> [k, P * T, C]`.

Cross-attention is exact per patch too, but its keys and values come from the image's text:
the UNet gets each image's text once (not a copy per patch), and cross-attention regathers its
queries like self-attention does, so every image's text is projected once per layer.

`patch_unet` installs these on an unmodified UNet from the outside (module wrappers and an
attention processor) and restores the originals on exit. The patch grid is the same at every
level of the UNet; only the patch side `s` changes, and it is read off each input.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from torch import nn

from gouache.attention import attend_segments, check_plain
from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.runner.layout import PatchLayout


@dataclass(frozen=True)
class PatchTensors:
    """A layout's per-patch indices as tensors on one device (n = num_patches)."""

    neighbours: torch.Tensor  # [4, n] left, right, top, bottom patch; n (halo_pad's zero patch) at the border
    image: torch.Tensor  # [n] layout position of each patch's image: segment ids for GroupNorm
    caller: torch.Tensor  # [n] caller index of each patch's image: which conditioning row it gets
    per_image: torch.Tensor  # [num_images] patches per image, in layout order
    offsets: torch.Tensor  # [num_images + 1] first patch of each image in layout order, then num_patches
    order: torch.Tensor  # [num_images] caller index of each layout position

    @classmethod
    def build(cls, layout: PatchLayout, pad: tuple[int, int] | None = None) -> PatchTensors:
        """`pad`: (patches, images) of a batch padded to static shapes (`pad_patches`): the extra
        patches are one more image (after the real ones, its patches' neighbours the border),
        the extra images after it hold no patch and take the first text row."""
        n, real = layout.num_patches, len(layout.order)
        patches, images = pad or (n, real)
        if patches < n or images < real + (patches > n):
            raise ValueError(f"{n} patches of {real} images do not fit a padding to {patches} and {images}")
        neighbours = torch.tensor(layout.neighbours, dtype=torch.long).reshape(n, 4).T
        neighbours = torch.cat([neighbours, neighbours.new_full((4, patches - n), -1)], dim=1)
        neighbours[neighbours < 0] = patches  # halo_pad's zero patch: the image border
        image = torch.tensor(layout.patch_image + (real,) * (patches - n), dtype=torch.long)
        order = torch.tensor(layout.order + (0,) * (images - real), dtype=torch.long)
        offsets = torch.tensor(layout.request_offsets + (patches,) * (images - real), dtype=torch.long)
        return cls(neighbours.contiguous(), image, order[image], offsets.diff(), offsets, order)

    def to(self, device: torch.device) -> PatchTensors:
        return PatchTensors(*(getattr(self, f.name).to(device) for f in fields(self)))


class PatchIndex:
    """A layout's index tensors, built once per layout and device (not per forward), and its
    resolution groups for self-attention."""

    def __init__(self, layout: PatchLayout, as_data: bool = False, pad: tuple[int, int] | None = None):
        """`as_data`: attention reads the layout as tensors only (`PatchAttnProcessor`), as a
        compiled graph of any mix must; `pad`: the batch is padded to (patches, images)
        (`pad_patches`; as data only)."""
        if pad is not None and not as_data:
            raise ValueError("a padded patch batch needs its attention as data")
        self.layout, self.as_data = layout, as_data
        self._by_device = {torch.device("cpu"): PatchTensors.build(layout, pad)}
        # Per resolution group: (first patch, image count, patches per image).
        self.groups = [(layout.request_offsets[pos], k, per) for pos, k, per in layout.groups]
        # Inside a block the block cache runs on some patches only (`block_cache.blocks.Subset`): the
        # operators then get those patches' rows and take the others' from the cache.
        self.subset = None

    def tensors(self, device: torch.device) -> PatchTensors:
        if device not in self._by_device:
            self._by_device[device] = self._by_device[torch.device("cpu")].to(device)
        return self._by_device[device]


# ---------------------------------------------------------------------------------- conv


def halo_pad(x: torch.Tensor, neighbours: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[n, C, s, s] -> [n, C, s + 2 rows, s + 2 cols]: each patch framed by its neighbours'
    border pixels, zeros at the image border. `neighbours` is `PatchIndex`'s [4, n] table.

    Two stages, four index_selects whatever n is: first the left/right columns, then whole
    padded rows from the top/bottom neighbours. Those rows already hold the top neighbour's
    left/right halo, i.e. the diagonal neighbours' corner pixels.
    """
    n, c, s, _ = x.shape
    if rows > s or cols > s:
        raise ValueError(f"halo {rows}x{cols} is wider than the patch side {s} at this level")
    # Patch n is all zeros: the image border's padding, where a neighbour index is n.
    out = x.new_empty(n + 1, c, s + 2 * rows, s + 2 * cols)
    out[n] = 0
    middle = slice(rows, rows + s)
    out[:n, :, middle, cols : cols + s] = x
    left, right, top, bottom = neighbours
    if cols:
        band = out[:, :, middle]
        out[:n, :, middle, :cols] = band[..., s : s + cols].index_select(0, left)
        out[:n, :, middle, s + cols :] = band[..., cols : 2 * cols].index_select(0, right)
    if rows:
        out[:n, :, :rows] = out[:, :, s : s + rows].index_select(0, top)
        out[:n, :, s + rows :] = out[:, :, rows : 2 * rows].index_select(0, bottom)
    return out[:n]


class HaloConv2d(nn.Module):
    """A Conv2d run on halo-padded patches; equal to the conv on each whole image."""

    def __init__(self, conv: nn.Conv2d, index: PatchIndex):
        super().__init__()
        self.halo = _check_conv(conv)
        self.conv, self.index = conv, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, stride = x.shape[-1], self.conv.stride
        if s % stride[0] or s % stride[1]:
            # A strided window would straddle patches differently from the whole image.
            raise ValueError(f"patch side {s} is not a multiple of the conv stride {stride}")
        subset = self.index.subset
        full = x if subset is None else subset.full(self.conv, x)
        padded = halo_pad(full, self.index.tensors(x.device).neighbours, *self.halo)
        if subset is not None:
            padded = subset.rows(padded)
        c = self.conv
        return F.conv2d(padded, c.weight, c.bias, c.stride, 0, c.dilation, c.groups)


def _check_conv(conv: nn.Conv2d) -> tuple[int, int]:
    """The (rows, cols) halo a conv needs: its padding, which must be the symmetric 'same'
    padding of an odd kernel, so that padding with neighbours instead of zeros is exact."""
    if type(conv).forward is not nn.Conv2d.forward:
        raise TypeError(f"{type(conv).__name__} overrides Conv2d.forward; cannot patch it exactly")
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(f"unsupported conv padding {conv.padding!r} ({conv.padding_mode})")
    for k, p, d in zip(conv.kernel_size, conv.padding, conv.dilation):
        if k % 2 == 0 or p != d * (k - 1) // 2:
            raise ValueError(
                f"conv kernel {conv.kernel_size} with padding {conv.padding}: only 'same' padding "
                "(dilation * (k - 1) / 2) can be replaced by a halo (diffusers' Downsample2D with "
                "padding=0 pads asymmetrically before the conv)"
            )
    return conv.padding[0], conv.padding[1]


# ------------------------------------------------------------------------------ groupnorm


class PatchGroupNorm(nn.Module):
    """GroupNorm with statistics over all patches of each image; equal to the whole image's."""

    def __init__(self, norm: nn.GroupNorm, index: PatchIndex):
        super().__init__()
        if type(norm).forward is not nn.GroupNorm.forward:
            raise TypeError(f"{type(norm).__name__} overrides GroupNorm.forward")
        self.norm, self.index = norm, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, g = self.index.tensors(x.device), self.norm.num_groups
        subset = self.index.subset
        full = x if subset is None else subset.full(self.norm, x)  # the cache's rows where not computed
        mean, rstd = self._statistics(full, idx, g)  # [num_images, G]
        image = idx.image if subset is None else subset.rows(idx.image)  # [n] each row's image
        # y = x * scale + shift per (row, channel), the affine folded in, in fp32 at least (as
        # torch's own kernel computes) and cast back once.
        per_channel = x.shape[1] // g
        scale = rstd.index_select(0, image).repeat_interleave(per_channel, dim=1)  # [n, C]
        shift = -mean.index_select(0, image).repeat_interleave(per_channel, dim=1) * scale
        if self.norm.affine:
            scale, shift = scale * self.norm.weight, shift * self.norm.weight + self.norm.bias
        shape = x.shape[:2] + (1,) * (x.ndim - 2)
        y = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)
        return y.mul_(scale.reshape(shape)).add_(shift.reshape(shape)).to(x.dtype)

    def _statistics(self, x: torch.Tensor, idx: PatchTensors, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per image and group: mean and 1/std [num_images, G], from each patch's own (torch's
        fused GroupNorm kernel, fp32) combined as Chan et al.'s parallel variance does: the
        image's variance is the patches' mean variance plus the variance of their means, with
        no E[x^2] - E[x]^2 to cancel when |mean| >> std. Every patch has as many pixels."""
        n, c = x.shape[:2]
        # fp32 weight and bias make the CPU kernel keep fp32 statistics of a half input (else half);
        # CUDA's refuses weights of another dtype than the input's (an H200 under `gouache profile`)
        if x.device.type != "cpu":
            x = x.float()
        unit = torch.ones(c, device=x.device), torch.zeros(c, device=x.device)
        _, mean, rstd = torch.ops.aten.native_group_norm(x, *unit, n, c, x[0, 0].numel(), groups, self.norm.eps)
        var = rstd.reshape(n, groups).double().pow(-2) - self.norm.eps  # each patch's own, to fp64
        mean = mean.reshape(n, groups).double()
        # [n], [num_images, 1]; a padded batch's images past the padding image have no patch
        image, count = idx.image, idx.per_image.unsqueeze(1).clamp(min=1)
        image_mean = _segment_sum(mean, image, len(count)) / count
        spread = (mean - image_mean.index_select(0, image)).square() + var
        image_var = _segment_sum(spread, image, len(count)) / count
        return image_mean.float(), torch.rsqrt(image_var + self.norm.eps).float()


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """[n, G] per patch -> [count, G] per image."""
    return values.new_zeros(count, values.shape[1]).index_add_(0, segment, values)


# ------------------------------------------------------------------------------ attention


class PatchAttnProcessor:
    """Wraps an attention processor: it sees every image of a resolution as one batch of its
    patches' tokens. Cross-attention gets each image's own text, [num_images, L, D] in caller
    order, and attends every query of the image's patches to it at once."""

    def __init__(self, inner: Callable[..., torch.Tensor], index: PatchIndex):
        self.inner, self.index = inner, index

    # The signature mirrors AttnProcessor2_0's: Attention.forward filters kwargs by it.
    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
        temb=None, *args, **kwargs,
    ) -> torch.Tensor:
        # Tokens of a patch batch, unmasked: a mask or a 4-D input would need regathering too.
        if hidden_states.ndim != 3 or attention_mask is not None:
            raise ValueError("patched attention takes [patches, tokens, C] without masks")
        subset = self.index.subset
        if subset is not None and subset.computed is not None:
            if encoder_hidden_states is not None:  # exact per patch: each computed patch with its text
                caller = subset.rows(self.index.tensors(hidden_states.device).caller)
                return self.inner(attn, hidden_states, encoder_hidden_states.index_select(0, caller), None, temb,
                                  *args, **kwargs)
            return self._attend_computed(attn, hidden_states, subset.full(attn, hidden_states), subset.computed, temb,
                                         *args, **kwargs)
        if subset is not None and encoder_hidden_states is None:
            subset.full(attn, hidden_states)  # the cache records what later steps' reused patches show
        if self.index.as_data:
            return self._attend_as_data(attn, hidden_states, encoder_hidden_states)
        return self._attend(attn, hidden_states, encoder_hidden_states, temb, *args, **kwargs)

    def _attend_as_data(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states) -> torch.Tensor:
        """Attention with the layout as data, no per-group Python: the projections over every
        token of the batch at once, each image's queries over its own tokens (self-attention:
        its patches' tokens are contiguous) or its own text (cross-attention: each image's text
        projected once), by `attend_segments`, whose segment cuts are tensors. So a compiled
        graph of this forward serves every mix of its patch count."""
        idx = self.index.tensors(hidden_states.device)
        n, t = hidden_states.shape[:2]
        x = hidden_states.flatten(0, 1)
        q_cuts = idx.offsets * t
        if encoder_hidden_states is None:
            context, kv_cuts = x, q_cuts
        else:
            text = encoder_hidden_states.index_select(0, idx.order)  # layout order
            context = text.flatten(0, 1)
            kv_cuts = torch.arange(len(text) + 1, device=x.device) * text.shape[1]
        heads = attn.heads
        q, k, v = (proj(y).unflatten(-1, (heads, -1)) for proj, y in ((attn.to_q, x), (attn.to_k, context),
                                                                     (attn.to_v, context)))
        out = attn.to_out[1](attn.to_out[0](attend_segments(q, k, v, q_cuts, kv_cuts)))
        return (out / attn.rescale_output_factor).unflatten(0, (n, t))

    def _attend_computed(self, attn: Attention, rows: torch.Tensor, full: torch.Tensor, computed: torch.Tensor, temb,
                         *args, **kwargs) -> torch.Tensor:
        """Self-attention of the computed patches' tokens (`rows`, in `computed` order) over
        every token of their image (`full`, stale where not computed): per image, its computed
        queries with all of its keys and values, so reused patches' queries cost nothing."""
        t, offsets = rows.shape[1], self.index.layout.request_offsets
        cuts = torch.searchsorted(computed, torch.tensor(offsets, device=computed.device)).tolist()
        outs = []
        for image, (a, b) in enumerate(itertools.pairwise(cuts)):
            if b > a:
                keys = full[offsets[image]:offsets[image + 1]].reshape(1, -1, full.shape[-1])
                y = self.inner(attn, rows[a:b].reshape(1, -1, rows.shape[-1]), keys, None, temb, *args, **kwargs)
                outs.append(y.reshape(b - a, t, -1))
        return torch.cat(outs)

    def _attend(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states, temb, *args, **kwargs):
        if encoder_hidden_states is not None:  # caller order -> layout order, once per call
            order = self.index.tensors(encoder_hidden_states.device).order
            encoder_hidden_states = encoder_hidden_states.index_select(0, order)
        t = hidden_states.shape[1]
        outs = []
        for (first, k, per), (position, _, _) in zip(self.index.groups, self.index.layout.groups):
            h = hidden_states[first : first + k * per].reshape(k, per * t, -1)
            text = None if encoder_hidden_states is None else encoder_hidden_states[position : position + k]
            y = self.inner(attn, h, text, None, temb, *args, **kwargs)
            outs.append(y.reshape(k * per, t, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


# ---------------------------------------------------------------------------- installation


@contextlib.contextmanager
def patch_unet(unet: nn.Module, layout: PatchLayout, as_data: bool = False,
               pad: tuple[int, int] | None = None) -> Iterator[PatchIndex]:
    """Make `unet` run on `layout`'s patch batch, with each image's text once (caller order);
    restore its modules and processors on exit. `as_data`, `pad`: as `PatchIndex` says."""
    index = PatchIndex(layout, as_data, pad)
    attention = [m for m in unet.modules() if isinstance(m, Attention)]
    if as_data:
        for m in attention:
            check_plain(m)
    swaps = _module_swaps(unet, index, skip={id(m) for m in attention if not m.is_cross_attention})
    processors = [(m, m.processor) for m in attention]
    try:
        for parent, name, _, new in swaps:
            setattr(parent, name, new)
        for module, inner in processors:
            module.set_processor(PatchAttnProcessor(inner, index))
        yield index
    finally:
        for parent, name, old, _ in swaps:
            setattr(parent, name, old)
        for module, inner in processors:
            module.set_processor(inner)


def _module_swaps(unet: nn.Module, index: PatchIndex, skip: set[int]) -> list[tuple]:
    """(parent, attribute, original, wrapper) for every conv and GroupNorm to replace. Built
    before any swap so that a failed check leaves the UNet untouched. Norms inside a patched
    self-attention module see whole images already."""
    swaps = []
    for parent in unet.modules():
        if id(parent) in skip:
            continue
        for name, child in parent.named_children():
            if isinstance(child, (HaloConv2d, PatchGroupNorm)):
                raise RuntimeError("this UNet is already patched; patch_unet does not nest")
            if isinstance(child, nn.Conv2d) and max(child.kernel_size) > 1:
                swaps.append((parent, name, child, HaloConv2d(child, index)))
            elif isinstance(child, nn.GroupNorm):
                swaps.append((parent, name, child, PatchGroupNorm(child, index)))
    return swaps


def patched_unet_forward(
    unet: nn.Module,
    layout: PatchLayout,
    samples: list[torch.Tensor],
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    whole_batches: bool = True,
    cache: CachedForward | None = None,
    as_data: bool = False,
) -> list[torch.Tensor]:
    """One UNet forward over every image of `layout`, cut into patches.

    samples: [C, h, w] per image in caller order; timestep: [num_images] (or a scalar);
    encoder_hidden_states: [num_images, L, D]; added_cond_kwargs: [num_images, ...] tensors.
    Returns the UNet's output as [C_out, h, w] per image, in caller order. Images all of one
    size need no patches: they run as the UNet's own batch, unless `whole_batches` is False
    (benchmarks timing the patch machinery itself). With a `cache`, blocks reuse cached outputs
    per patch (per image when unpatched). `as_data`: attention reads the layout as tensors only
    (`PatchAttnProcessor._attend_as_data`).
    """
    if whole_batches and len({x.shape for x in samples}) == 1:
        with cached_blocks(unet, cache and cache.begin()):
            return list(unet(torch.stack(samples), timestep, encoder_hidden_states,
                             added_cond_kwargs=added_cond_kwargs, return_dict=False)[0])
    inputs = patch_inputs(layout, samples, timestep, encoder_hidden_states, added_cond_kwargs)
    return layout.merge(run_patches(unet, layout, inputs, cache, as_data))


def patch_inputs(layout: PatchLayout, samples: list[torch.Tensor], timestep: torch.Tensor,
                 encoder_hidden_states: torch.Tensor, added_cond_kwargs: dict[str, torch.Tensor] | None = None) -> dict:
    """The UNet's keyword inputs over `layout`'s patches (`patched_unet_forward`'s arguments):
    the patches, each image's timestep and added conditioning repeated per patch, its text once
    per image (caller order)."""
    x = layout.split(samples)
    caller = torch.tensor(layout.order, device=x.device)[torch.tensor(layout.patch_image, device=x.device)]

    def per_patch(t: torch.Tensor) -> torch.Tensor:  # repeat an image's conditioning
        return t if t.ndim == 0 else t.index_select(0, caller.to(t.device))

    added = {k: per_patch(v) for k, v in (added_cond_kwargs or {}).items()} or None
    return {"sample": x, "timestep": per_patch(torch.as_tensor(timestep, device=x.device)),
            "encoder_hidden_states": encoder_hidden_states, "added_cond_kwargs": added}


def pad_patches(inputs: dict, pad: tuple[int, int]) -> dict:
    """`patch_inputs` padded to (patches, images) (`PatchTensors.build`): copies of the last
    patch and its conditioning, copies of the last image's text. The padding's outputs come
    after the real patches'."""
    patches, images = pad
    out = {}
    for name, value in inputs.items():
        if isinstance(value, dict):
            out[name] = pad_patches(value, pad)
        elif isinstance(value, torch.Tensor) and value.ndim:
            n = images if name == "encoder_hidden_states" else patches
            out[name] = torch.cat([value, value[-1:].expand(n - len(value), *value.shape[1:])])
        else:
            out[name] = value
    return out


def run_patches(unet: nn.Module, layout: PatchLayout, inputs: dict, cache: CachedForward | None = None,
                as_data: bool = False) -> torch.Tensor:
    """The UNet's output patches [num_patches, C_out, s, s] from `patch_inputs`."""
    factor = 2 ** getattr(unet, "num_upsamplers", 0)
    if layout.patch % factor:
        raise ValueError(f"patch side {layout.patch} must be a multiple of {factor} for this UNet's levels")
    cache_pass = cache and cache.begin(
        [b - a for a, b in zip(layout.request_offsets, layout.request_offsets[1:])], layout.order,
        f"patch{layout.patch}")
    with patch_unet(unet, layout, as_data) as index, cached_blocks(unet, cache_pass, "patch", index):
        return unet(**inputs, return_dict=False)[0]
