"""Upload decoding and output encoding (gouache.engine.imaging), on hand-made images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import ExifTags, Image

from gouache.engine.imaging import DecodeError, decode_edit, encode_image, read_size
from gouache.request import ImageRequest
from gouache.uploads import Upload

KEY = (10, 20, 30)  # a PNG colour key (tRNS): pixels of exactly this colour are transparent
MAX_PIXELS = 1 << 20


@pytest.fixture(autouse=True)
def _restore_pillow_pixel_limit(monkeypatch: pytest.MonkeyPatch):
    # decode_edit sets Pillow's global decompression-bomb limit; later tests must not inherit it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


def _png(pixels: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", **options)
    return buffer.getvalue()


def _keyed_rgb() -> tuple[bytes, np.ndarray]:
    """An RGB PNG with a colour key: bright pixels, dark pixels and keyed ones; and where the keyed ones are."""
    pixels = np.full((8, 8, 3), 250, np.uint8)
    pixels[:, :4] = 40
    keyed = np.zeros((8, 8), bool)
    keyed[2:5, 1:6] = True
    pixels[keyed] = KEY
    return _png(pixels, transparency=KEY), keyed


def _edit(image: bytes, mask: bytes | None = None, width: int = 8, height: int = 8) -> ImageRequest:
    return ImageRequest("e", "a cat", width, height, 2, 4.0, seed=0, image=image, mask=mask)


def _decode(image: bytes, mask: bytes | None = None, width: int = 8, height: int = 8) -> Upload:
    decoded = decode_edit(_edit(image, mask, width, height), MAX_PIXELS)
    assert isinstance(decoded, Upload), decoded
    return decoded


def test_rgb_image_with_colour_key_and_no_mask_repaints_the_keyed_pixels():
    image, keyed = _keyed_rgb()
    assert np.array_equal(_decode(image).mask.pixels, keyed.astype(np.float32))


def test_rgb_mask_with_colour_key_repaints_the_keyed_pixels():
    mask, keyed = _keyed_rgb()
    image = _png(np.zeros((8, 8, 3), np.uint8))
    assert np.array_equal(_decode(image, mask).mask.pixels, keyed.astype(np.float32))


def test_greyscale_mask_with_colour_key_repaints_the_keyed_pixels():
    pixels = np.full((8, 8), 60, np.uint8)  # all dark: read as luminance, nothing would be repainted
    pixels[3:6, 2:4] = 0
    mask = _png(pixels, transparency=0)
    image = _png(np.zeros((8, 8, 3), np.uint8))
    assert np.array_equal(_decode(image, mask).mask.pixels, (pixels == 0).astype(np.float32))


def test_rgba_image_without_mask_repaints_its_transparent_pixels():
    pixels = np.full((8, 8, 4), 255, np.uint8)
    pixels[:2, :, 3] = 0
    pixels[2:4, :, 3] = 128  # half transparent is kept, as OpenAI does
    decoded = _decode(_png(pixels))
    assert np.array_equal(decoded.mask.pixels, (pixels[..., 3] == 0).astype(np.float32))
    assert decoded.image.shape == (8, 8, 3)


def test_opaque_image_without_mask_is_repainted_whole():
    assert np.array_equal(_decode(_png(np.zeros((8, 8, 3), np.uint8))).mask.pixels, np.ones((8, 8), np.float32))


def test_mask_without_transparency_repaints_its_white_pixels():
    pixels = np.zeros((8, 8), np.uint8)
    pixels[4:] = 255
    image = _png(np.zeros((8, 8, 3), np.uint8))
    assert np.array_equal(_decode(image, _png(pixels)).mask.pixels, (pixels == 255).astype(np.float32))


def test_palette_and_la_masks_use_their_transparency():
    indices = np.zeros((8, 8), np.uint8)
    indices[:, 5:] = 1
    palette = Image.fromarray(indices, "P")
    palette.putpalette([0, 0, 0, 255, 255, 255])
    buffer = io.BytesIO()
    palette.save(buffer, "PNG", transparency=1)
    la = np.stack([np.full((8, 8), 255, np.uint8), np.where(indices == 1, 0, 255).astype(np.uint8)], axis=-1)
    image = _png(np.zeros((8, 8, 3), np.uint8))
    for mask in (buffer.getvalue(), _png(la)):
        assert np.array_equal(_decode(image, mask).mask.pixels, (indices == 1).astype(np.float32))


def test_image_and_mask_are_resized_to_the_request():
    pixels = np.full((8, 8, 4), 255, np.uint8)
    pixels[2:5, 1:6, 3] = 0
    decoded = _decode(_png(pixels), width=16, height=8)
    assert decoded.image.shape == (8, 16, 3) and decoded.mask.pixels.shape == (8, 16)
    assert np.array_equal(decoded.mask.pixels[:, ::2], (pixels[..., 3] == 0).astype(np.float32))


@pytest.mark.parametrize(
    ("image", "mask", "param"),
    [(b"not an image", None, "image"), (_png(np.zeros((8, 8, 3), np.uint8)), b"GIF89a?", "mask"),
     (_png(np.zeros((8, 8, 3), np.uint8)), _png(np.zeros((4, 4), np.uint8)), "mask")],
)  # fmt: skip
def test_bad_uploads_name_their_field(image: bytes, mask: bytes | None, param: str):
    decoded = decode_edit(_edit(image, mask), MAX_PIXELS)
    assert isinstance(decoded, DecodeError) and decoded.param == param


def test_too_many_pixels_is_an_error_not_a_decode():
    decoded = decode_edit(_edit(_png(np.zeros((64, 64, 3), np.uint8))), max_pixels=1000)
    assert isinstance(decoded, DecodeError) and decoded.param == "image" and "1000" in decoded.message


@pytest.mark.parametrize(("output_format", "pil_format"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_compression_sets_the_lossy_quality(output_format: str, pil_format: str):
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    low, default = encode_image(pixels, output_format, 10), encode_image(pixels, output_format)
    assert len(low) < len(default) // 2
    assert Image.open(io.BytesIO(low)).format == pil_format


def test_an_exif_turned_photo_is_decoded_upright_and_its_size_read_upright():
    """A phone photo stored 8x4 with orientation 6 (turn 90 degrees clockwise) is shown 4x8; its
    browser-painted mask is 4x8, so the server must read it upright too."""
    pixels = np.zeros((4, 8, 3), np.uint8)  # stored: 8 wide, 4 high
    pixels[0, 0] = 255  # stored top left: upright, the top right
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", exif=exif)
    photo = buffer.getvalue()
    mask = np.full((8, 4, 4), 255, np.uint8)
    mask[:, 2:, 3] = 0  # repaint the right half of the upright picture
    decoded = _decode(photo, _png(mask), width=4, height=8)
    assert read_size(photo, "image") == (4, 8)
    assert decoded.image.shape == (8, 4, 3) and decoded.image[0, 3].tolist() == [255, 255, 255]
    assert decoded.mask.pixels[:, 2:].all() and not decoded.mask.pixels[:, :2].any()
