"""CPU-heavy image work that runs in worker processes: upload decoding and output encoding;
and the one cheap read the API does itself, an upload's size from its header.

Imports only Pillow, NumPy and torch-free modules of ours so that worker processes start fast and
never touch the model. Errors come back as values, since exception pickling across processes loses fields.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from gouache.request import ImageRequest
from gouache.uploads import EditMask, Upload

_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
_UNREADABLE = (UnidentifiedImageError, OSError, ValueError, SyntaxError)  # what Pillow raises on bad bytes
_TURNED = (5, 6, 7, 8)  # EXIF orientations that swap width and height


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
            ImageOps.exif_transpose(image, in_place=True)  # upright, as a browser or viewer shows it
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return DecodeError(f"{field} has more than {max_pixels} pixels; send a smaller image", field)
    except _UNREADABLE:
        return _unreadable(field)
    return image


def _unreadable(field: str) -> DecodeError:
    return DecodeError(f"{field} is not a readable PNG, JPEG or WebP image", field)


def read_size(data: bytes, field: str) -> tuple[int, int] | DecodeError:
    """An upload's (width, height) from its header alone, upright (EXIF orientation applied, as
    `_open` does); its pixels are not decoded."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            turned = image.getexif().get(ExifTags.Base.Orientation) in _TURNED
            return (height, width) if turned else (width, height)
    except Image.DecompressionBombError:
        return DecodeError(f"{field} has too many pixels; send a smaller image", field)
    except _UNREADABLE:
        return _unreadable(field)


def _transparent(image: Image.Image) -> np.ndarray | None:
    """1 at fully transparent pixels, or None if the image has no transparency at all.

    Pillow's `has_transparency_data` covers alpha channels, palettes with alpha and PNG colour
    keys (tRNS, `info["transparency"]`); converting to RGBA turns a keyed pixel's alpha to 0.
    """
    if not image.has_transparency_data:
        return None
    return (np.asarray(image.convert("RGBA"))[..., 3] == 0).astype(np.float32)


def _repaint_region(image: Image.Image, mask: Image.Image | None) -> np.ndarray:
    """float32 [H, W], 1 = repaint (OpenAI's rule): the fully transparent pixels of the mask, or
    of the image when there is no mask. A mask without transparency repaints its white pixels;
    an opaque image without a mask is repainted whole."""
    transparent = _transparent(image if mask is None else mask)
    if transparent is not None:
        return transparent
    if mask is None:
        return np.ones((image.height, image.width), np.float32)
    return (np.asarray(mask.convert("L")) >= 128).astype(np.float32)


def decode_edit(request: ImageRequest, max_pixels: int, min_side: int = 1) -> Upload | DecodeError:
    """Decode, validate and resize an edit's image and mask to the request's size; its further
    uploads (`references`) keep their sizes, each at least `min_side` pixels a side."""
    width, height = request.width, request.height
    decoded = []
    for k, data in enumerate(request.references, 2):
        reference = _open(data, "image", max_pixels)
        if isinstance(reference, DecodeError):
            return DecodeError(f"image {k}: {reference.message}", "image")
        if min(reference.size) < min_side:
            return DecodeError(f"image {k} is {reference.width}x{reference.height}; each side must be at least "
                               f"{min_side} pixels", "image")
        decoded.append(np.asarray(reference.convert("RGB"), dtype=np.uint8))
    image = _open(request.image, "image", max_pixels)
    if isinstance(image, DecodeError):
        return image
    mask_image = None
    if request.mask is not None:
        mask_image = _open(request.mask, "mask", max_pixels)
        if isinstance(mask_image, DecodeError):
            return mask_image
        if mask_image.size != image.size:
            return DecodeError(f"mask is {mask_image.width}x{mask_image.height} but image is "
                               f"{image.width}x{image.height}; they must match", "mask")
    mask = _repaint_region(image, mask_image)
    if image.size != (width, height):
        mask = np.asarray(Image.fromarray((mask * 255).astype(np.uint8))
                          .resize((width, height), Image.Resampling.NEAREST)) / 255.0
    return Upload(_rgb_at(image, width, height), EditMask(mask.astype(np.float32)), tuple(decoded))


def decode_reference(request: ImageRequest, max_pixels: int, *_) -> Upload | DecodeError:
    """Decode and validate a clip's first frame (`input_reference`) and resize it to the clip's
    size, as an edit's image is; it has no mask (transparency is no region of a first frame)."""
    image = _open(request.image, "input_reference", max_pixels)
    if isinstance(image, DecodeError):
        return image
    return Upload(_rgb_at(image, request.width, request.height))


def _rgb_at(image: Image.Image, width: int, height: int) -> np.ndarray:
    """An upload as uint8 [height, width, 3], resized (bicubic) if it is another size."""
    rgb = image.convert("RGB")
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.uint8)


def decode_controls(images: list[bytes], width: int, height: int, max_pixels: int) -> list[np.ndarray] | DecodeError:
    """A request's ControlNet conditioning images, uint8 [H, W, 3]; each must be the request's
    size (a control image is a map of the picture: resizing it would move what it controls)."""
    out = []
    for k, data in enumerate(images):
        field = f"controlnets[{k}].image"
        image = _open(data, field, max_pixels)
        if isinstance(image, DecodeError):
            return DecodeError(image.message, "controlnets")
        if image.size != (width, height):
            return DecodeError(f"{field} is {image.width}x{image.height}; it must be the image's size, "
                               f"{width}x{height}", "controlnets")
        out.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
    return out


def repaint_ratio(request: ImageRequest, max_pixels: int) -> float:
    """The fraction of an edit's image that it repaints, at the upload's size (routers read it);
    1.0 when an upload cannot be read, which the engine then refuses with the reason."""
    image = _open(request.image, "image", max_pixels)
    mask = None if request.mask is None else _open(request.mask, "mask", max_pixels)
    if isinstance(image, DecodeError) or isinstance(mask, DecodeError):
        return 1.0
    return float(_repaint_region(image, mask).mean())


def encode_image(pixels: np.ndarray, output_format: str, compression: int | None = None) -> bytes:
    """uint8 [H, W, 3] -> PNG / JPEG / WebP bytes; `compression` is the JPEG / WebP quality
    (0-100, OpenAI's `output_compression`), 95 when None."""
    buffer = io.BytesIO()
    options = ({"compress_level": 4} if output_format == "png"
               else {"quality": 95 if compression is None else compression})
    Image.fromarray(pixels).save(buffer, format=_FORMATS[output_format], **options)
    return buffer.getvalue()
