"""CPU-heavy image work that runs in worker processes: upload decoding and output encoding.

Imports only Pillow and NumPy so that worker processes start fast and never touch the model.
Errors come back as values, since exception pickling across processes loses fields.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


@dataclass
class DecodedEdit:
    image: np.ndarray  # uint8 [H, W, 3] at the requested size
    mask: np.ndarray  # float32 [H, W] at the requested size; 1 = repaint


@dataclass
class DecodeError:
    message: str
    param: str  # the form field to fix: image | mask


def _open(data: bytes, field: str, max_pixels: int) -> Image.Image | DecodeError:
    Image.MAX_IMAGE_PIXELS = max_pixels  # set deliberately: larger uploads are decompression bombs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return DecodeError(f"{field} has more than {max_pixels} pixels; send a smaller image", field)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return DecodeError(f"{field} is not a readable PNG, JPEG or WebP image", field)
    return image


def _repaint_mask(image: Image.Image) -> np.ndarray:
    """1 where to repaint. With alpha: fully transparent pixels (OpenAI). Without: white pixels."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        alpha = np.asarray(image.convert("RGBA"))[..., 3]
        return (alpha == 0).astype(np.float32)
    return (np.asarray(image.convert("L")) >= 128).astype(np.float32)


def decode_edit(image_bytes: bytes, mask_bytes: bytes | None, width: int, height: int, max_pixels: int) -> DecodedEdit | DecodeError:
    """Decode, validate and resize an edit's image and mask to width x height."""
    image = _open(image_bytes, "image", max_pixels)
    if isinstance(image, DecodeError):
        return image
    if mask_bytes is None:
        has_alpha = image.mode in ("RGBA", "LA") or "transparency" in image.info
        mask = _repaint_mask(image) if has_alpha else np.ones((image.height, image.width), np.float32)
    else:
        mask_image = _open(mask_bytes, "mask", max_pixels)
        if isinstance(mask_image, DecodeError):
            return mask_image
        if mask_image.size != image.size:
            return DecodeError(f"mask is {mask_image.width}x{mask_image.height} but image is {image.width}x{image.height}; they must match", "mask")
        mask = _repaint_mask(mask_image)
    rgb = image.convert("RGB")
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
        mask = np.asarray(Image.fromarray((mask * 255).astype(np.uint8)).resize((width, height), Image.Resampling.NEAREST)) / 255.0
    return DecodedEdit(np.asarray(rgb, dtype=np.uint8), mask.astype(np.float32))


def encode_image(pixels: np.ndarray, output_format: str) -> bytes:
    """uint8 [H, W, 3] -> PNG / JPEG / WebP bytes."""
    buffer = io.BytesIO()
    options = {"compress_level": 4} if output_format == "png" else {"quality": 95}
    Image.fromarray(pixels).save(buffer, format=_FORMATS[output_format], **options)
    return buffer.getvalue()
