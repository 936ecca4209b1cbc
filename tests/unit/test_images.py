"""Image decoding: sniffed format, limits, conversion of every mode to RGB."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tgi_vlm.config import InputLimits
from tgi_vlm.images import ImageError, decode_image

LIMITS = InputLimits()


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


@pytest.mark.parametrize(
    "image_bytes",
    [
        encode(Image.new("P", (8, 8), 3)),
        encode(Image.new("RGBA", (8, 8), (1, 2, 3, 4))),
        encode(Image.new("LA", (8, 8), (5, 6))),
        encode(Image.new("CMYK", (8, 8), (1, 2, 3, 4)), "JPEG"),
        encode(Image.new("I;16", (8, 8), 4000)),
        encode(Image.new("L", (8, 8), 7)),
        encode(Image.new("1", (8, 8), 1)),
        encode(Image.new("P", (8, 8), 1), "GIF", save_all=True, append_images=[Image.new("P", (8, 8), 2)]),
        encode(Image.new("RGB", (8, 8)), "WEBP"),
    ],
    ids=["palette", "rgba", "la", "cmyk", "16bit", "gray", "bilevel", "animated-gif", "webp"],
)
def test_every_mode_becomes_rgb(image_bytes):
    image = decode_image(image_bytes, LIMITS)
    assert image.mode == "RGB" and image.size == (8, 8)


def test_png_labelled_jpeg_is_sniffed():
    assert decode_image(encode(Image.new("RGB", (20, 20))), LIMITS).size == (20, 20)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"not an image at all", "cannot decode"),
        (encode(Image.new("RGB", (64, 64)))[:50], "corrupt or truncated"),
        (encode(Image.new("RGB", (64, 64)), "JPEG")[:200], "corrupt or truncated"),
    ],
    ids=["empty", "garbage", "truncated-png", "truncated-jpeg"],
)
def test_bad_bytes_are_refused_with_a_reason(data, reason):
    with pytest.raises(ImageError, match=reason):
        decode_image(data, LIMITS)


def test_pixel_limit_is_checked_before_decoding():
    bomb = encode(Image.new("1", (20_000, 20_000)))  # tiny file, 400M pixels
    assert len(bomb) < 100_000
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(bomb, LIMITS)


def test_byte_limit():
    with pytest.raises(ImageError, match="bytes, over the limit of 10"):
        decode_image(encode(Image.new("RGB", (8, 8))), InputLimits(max_image_bytes=10))
