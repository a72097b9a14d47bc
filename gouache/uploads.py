"""An edit's decoded uploads (`Upload`) and its mask (`EditMask`), in every form the code reads.

The API keeps the uploads encoded on the `ImageRequest`; a codec process decodes them into an
`Upload` (`gouache.engine.imaging.decode_edit`) and the runner prepares the edit from it. The
mask is one value from there on: its pixels at the requested size (1 = repaint, OpenAI's rule),
and derived from them, the one way each, its pixel form on a device (the final composite), its
latent form (the blend of the kept region) and its token form (the tokens a template replay
computes).

Imports only NumPy at module level, so that the codec processes never load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EditMask:
    """Where an edit repaints: float32 [H, W] at the requested size, 1 = repaint."""

    pixels: np.ndarray

    @classmethod
    def whole(cls, height: int, width: int) -> EditMask:
        """Repaint everything (an upload without a mask or transparency)."""
        return cls(np.ones((height, width), np.float32))

    def kept(self) -> EditMask:
        """Repaint nothing: what a template records is the whole original."""
        return EditMask(np.zeros_like(self.pixels))

    @property
    def repaints_nothing(self) -> bool:
        return not self.pixels.any()

    def pixel(self, device, dtype) -> torch.Tensor:
        """[1, 1, H, W] in {0, 1} on `device`."""
        import torch

        return torch.from_numpy((self.pixels >= 0.5).astype(np.float32))[None, None].to(device, dtype)

    def latent(self, hw: tuple[int, int], device, dtype) -> torch.Tensor:
        """[1, 1, h, w] at the latent grid `hw`: the pixel form resized (nearest)."""
        import torch

        return torch.nn.functional.interpolate(self.pixel(device, dtype), size=hw)

    def tokens(self, hw: tuple[int, int], pool: int, device) -> torch.Tensor:
        """[tokens] bool, raster order: the tokens of `pool` x `pool` latent pixels (latent grid
        `hw`) that it repaints; a token is repainted if any of its latent pixels is."""
        import torch

        latent = self.latent(hw, device, torch.float32)[0]
        return torch.nn.functional.max_pool2d(latent, pool).flatten() > 0


@dataclass(frozen=True)
class Upload:
    """An edit's decoded uploads: its image at the requested size, its mask (None: none was
    given, which an instruction-edit model reads as an instruction edit) and its further
    uploads at their own sizes (the models that take several images)."""

    image: np.ndarray  # uint8 [H, W, 3]
    mask: EditMask | None = None
    references: tuple[np.ndarray, ...] = ()  # uint8 [h, w, 3] each

    @classmethod
    def blank(cls, height: int, width: int) -> Upload:
        """A black image that is repainted whole: a generation on a model that needs an image."""
        return cls(np.zeros((height, width, 3), np.uint8), EditMask.whole(height, width))

    @property
    def repaints_nothing(self) -> bool:
        """Its mask repaints nothing: the answer is its image, with no model run."""
        return self.mask is not None and self.mask.repaints_nothing

    def for_template(self) -> Upload:
        """The upload as a template records it: every token kept, none repainted."""
        return Upload(self.image, self.region().kept(), self.references)

    def region(self) -> EditMask:
        """Its mask, or without one the whole image."""
        return self.mask if self.mask is not None else EditMask.whole(*self.image.shape[:2])

    def masked(self) -> Upload | None:
        """Itself if it has a mask, else None: families whose edits without a mask take the
        upload as reference tokens hand their masked edits alone to the blending path."""
        return self if self.mask is not None else None
