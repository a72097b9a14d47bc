"""Patch layout: PatchedServe's Offset-Based Compression (OBC) of a mixed-resolution batch.

Every image (one per CFG row of each request) is cut into square patches of one common
size. Images are ordered by resolution, so the patches of one image are contiguous
(`request_offsets`) and so are the images of one resolution (`resolution_offsets`): regathering
an image, or all images of a resolution, is a reshape, not a gather. Patches of an image are
in raster order. Each patch knows its grid position and its four neighbours (-1 at the
image border), which is what halo stitching needs.

The index bookkeeping is plain Python; `split` / `merge` move tensors in and out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

NO_NEIGHBOUR = -1


@dataclass(frozen=True)
class PatchLayout:
    patch: int  # patch side, in latent pixels at the denoiser's input
    shapes: tuple[tuple[int, int], ...]  # [num_images] (height, width), in the caller's order
    order: tuple[int, ...]  # [num_images] caller index of the image at each layout position

    @classmethod
    def build(cls, shapes: list[tuple[int, int]], patch: int) -> PatchLayout:
        for h, w in shapes:
            if h % patch or w % patch:
                raise ValueError(f"latent size {h}x{w} is not a multiple of the patch size {patch}")
        order = sorted(range(len(shapes)), key=lambda i: (shapes[i][0], shapes[i][1]))  # stable: FCFS within a size
        return cls(patch, tuple(tuple(s) for s in shapes), tuple(order))

    # -- offsets -----------------------------------------------------------------------------

    def grid(self, position: int) -> tuple[int, int]:
        """(rows, cols) of patches of the image at layout `position`."""
        h, w = self.shapes[self.order[position]]
        return h // self.patch, w // self.patch

    @cached_property
    def request_offsets(self) -> tuple[int, ...]:
        """[num_images + 1] first patch of each image in layout order; the last is num_patches."""
        offsets = [0]
        for position in range(len(self.order)):
            rows, cols = self.grid(position)
            offsets.append(offsets[-1] + rows * cols)
        return tuple(offsets)

    @cached_property
    def resolution_offsets(self) -> tuple[int, ...]:
        """[num_resolutions + 1] first patch of each resolution group; the last is num_patches."""
        offsets = [0]
        for position in range(1, len(self.order) + 1):
            if position == len(self.order) or self.shape_at(position) != self.shape_at(position - 1):
                offsets.append(self.request_offsets[position])
        return tuple(offsets)

    @cached_property
    def groups(self) -> tuple[tuple[int, int, int], ...]:
        """Per resolution group: (first layout position, image count, patches per image)."""
        out, start = [], 0
        for position in range(1, len(self.order) + 1):
            if position == len(self.order) or self.shape_at(position) != self.shape_at(start):
                rows, cols = self.grid(start)
                out.append((start, position - start, rows * cols))
                start = position
        return tuple(out)

    def shape_at(self, position: int) -> tuple[int, int]:
        return self.shapes[self.order[position]]

    @property
    def num_patches(self) -> int:
        return self.request_offsets[-1]

    # -- per patch ---------------------------------------------------------------------------

    @cached_property
    def patch_image(self) -> tuple[int, ...]:
        """[num_patches] layout position of the image each patch belongs to."""
        return tuple(p for p in range(len(self.order))
                     for _ in range(self.request_offsets[p + 1] - self.request_offsets[p]))

    @cached_property
    def patch_position(self) -> tuple[tuple[int, int], ...]:
        """[num_patches] (row, col) of each patch in its image's patch grid (raster order)."""
        out = []
        for position in range(len(self.order)):
            rows, cols = self.grid(position)
            out.extend((r, c) for r in range(rows) for c in range(cols))
        return tuple(out)

    @cached_property
    def neighbours(self) -> tuple[tuple[int, int, int, int], ...]:
        """[num_patches] (left, right, top, bottom) patch indices, NO_NEIGHBOUR at the border."""
        out = []
        for index, (row, col) in enumerate(self.patch_position):
            rows, cols = self.grid(self.patch_image[index])
            out.append((
                index - 1 if col > 0 else NO_NEIGHBOUR,
                index + 1 if col < cols - 1 else NO_NEIGHBOUR,
                index - cols if row > 0 else NO_NEIGHBOUR,
                index + cols if row < rows - 1 else NO_NEIGHBOUR,
            ))
        return tuple(out)

    # -- tensors -----------------------------------------------------------------------------

    def split(self, images: list[torch.Tensor]) -> torch.Tensor:
        """[C, h, w] per image (caller order) -> [num_patches, C, p, p] in layout order."""
        p, parts = self.patch, []
        for index in self.order:
            x = images[index]
            c, h, w = x.shape
            x = x.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4)
            parts.append(x.reshape(-1, c, p, p))
        return torch.cat(parts)

    def merge(self, patches: torch.Tensor) -> list[torch.Tensor]:
        """[num_patches, C, s, s] -> [C, H, W] per image in caller order (s may differ from p:
        the layout's grid holds at every resolution level of a UNet)."""
        s, c = patches.shape[-1], patches.shape[1]
        out: list[torch.Tensor | None] = [None] * len(self.order)
        for position, index in enumerate(self.order):
            rows, cols = self.grid(position)
            x = patches[self.request_offsets[position] : self.request_offsets[position + 1]]
            out[index] = x.reshape(rows, cols, c, s, s).permute(2, 0, 3, 1, 4).reshape(c, rows * s, cols * s)
        return out
