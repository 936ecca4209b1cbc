"""Odd images are converted, not refused (README, "Checked per request"): the pixels that come out.

test_images.py checks that every mode becomes RGB of the right size; here each conversion is pinned
to exact values: alpha is composited on white, a palette's transparent index becomes white, an
animation gives its first frame, 16-bit gray is scaled by 1/256 (truncating), CMYK goes through
PIL's conversion, grayscale is replicated into R, G and B, and RGB passes through untouched.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tgi_vlm.config import InputLimits
from tgi_vlm.images import decode_image, make_test_image

LIMITS = InputLimits()
WHITE = (255, 255, 255)
RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def pixels(data: bytes) -> list[tuple[int, int, int]]:
    image = decode_image(data, LIMITS)
    assert image.mode == "RGB"
    return [tuple(int(c) for c in p) for p in np.asarray(image).reshape(-1, 3)]  # row by row


def row(mode: str, *values) -> Image.Image:
    """A 1-pixel-high image of `mode` with the given pixel values, left to right."""
    image = Image.new(mode, (len(values), 1))
    for x, value in enumerate(values):
        image.putpixel((x, 0), value)
    return image


def test_rgba_is_composited_on_white():
    # Half-transparent red over white: 255·128/255 + 255·127/255 = 255 for R, 0 + 255·127/255 = 127 for G and B.
    # On black it would be (128, 0, 0); with alpha dropped (255, 0, 0) and, for the transparent pixels, their colour.
    image = row("RGBA", (255, 0, 0, 128), (0, 0, 0, 0), (0, 255, 0, 0), (10, 20, 30, 255))
    assert pixels(encode(image)) == [(255, 127, 127), WHITE, WHITE, (10, 20, 30)]


def test_gray_with_alpha_is_composited_on_white():
    # 100·128/255 + 255·127/255 = 177.2; the colour of a fully transparent pixel does not show.
    image = row("LA", (100, 128), (0, 0), (37, 255))
    assert pixels(encode(image)) == [(177, 177, 177), WHITE, (37, 37, 37)]


def test_a_palette_keeps_its_colours_and_its_transparent_index_becomes_white():
    image = row("P", 0, 1, 2)
    image.putpalette([*RED, *BLUE, 0, 128, 0] + [0] * (256 - 3) * 3)
    data = encode(image, transparency=1)  # index 1 (blue) is transparent
    assert Image.open(io.BytesIO(data)).mode == "P"
    assert pixels(data) == [RED, WHITE, (0, 128, 0)]


def test_a_palette_with_an_alpha_table_is_composited_on_white():
    image = row("P", 0, 1)
    image.putpalette([*RED, *BLUE] + [0] * 254 * 3)
    data = encode(image, transparency=bytes([255, 0]))  # tRNS: index 0 opaque, index 1 transparent
    assert pixels(data) == [RED, WHITE]


@pytest.mark.parametrize(("fmt", "options"), [("GIF", {}), ("PNG", {}), ("WEBP", {"lossless": True})],
                         ids=["gif", "apng", "webp"])
def test_an_animation_gives_its_first_frame(fmt, options):
    frames = [Image.new("RGB", (4, 4), colour) for colour in (RED, BLUE, (0, 255, 0))]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)
    opened = Image.open(io.BytesIO(data))
    assert opened.is_animated and opened.n_frames == 3
    assert pixels(data) == [RED] * 16


# 16-bit gray → 8-bit by value / 256, truncated: 65535 → 255, 100·256 → 100, 200·256 + 255 → 200, 255 → 0.
# Unscaled, PIL clips (100·256 → 255); divided by 257 or 255, 100·256 → 99 or 200·256 + 255 → 201.
def test_16_bit_gray_is_scaled_to_8_bits():
    values = [65535, 100 * 256, 200 * 256 + 255, 128 * 256, 255, 0]
    image = row("I;16", *values)
    data = encode(image)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert pixels(data) == [(v, v, v) for v in (255, 100, 200, 128, 0, 0)]


# PIL: R = (255 − C)(255 − K)/255, likewise G from M and B from Y, rounded.
CMYK = [((255, 0, 0, 0), (0, 255, 255)), ((0, 255, 0, 0), (255, 0, 255)), ((0, 0, 0, 255), (0, 0, 0)),
        ((0, 0, 0, 128), (127, 127, 127)), ((51, 102, 0, 64), (153, 115, 191))]


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG"])
@pytest.mark.parametrize(("cmyk", "rgb"), CMYK, ids=["cyan", "magenta", "black", "half-key", "mixed"])
def test_cmyk_becomes_the_rgb_of_pils_conversion(fmt, cmyk, rgb):
    data = encode(Image.new("CMYK", (8, 8), cmyk), fmt, **({"quality": 100} if fmt == "JPEG" else {}))
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    assert pixels(data) == [rgb] * 64  # a flat JPEG block is exact at quality 100


def test_grayscale_is_replicated_into_rgb():
    assert pixels(encode(row("L", 0, 7, 128, 255))) == [(0, 0, 0), (7, 7, 7), (128, 128, 128), WHITE]


def test_bilevel_is_black_and_white():
    assert pixels(encode(row("1", 0, 1))) == [(0, 0, 0), WHITE]


def test_rgb_passes_through_unchanged():
    image = make_test_image(16, 8, seed=3)
    decoded = decode_image(encode(image), LIMITS)
    assert np.array_equal(np.asarray(decoded), np.asarray(image))
