"""Deterministic test images and their encoded bytes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def make_test_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A `width`×`height` RGB image of uniform random noise; the same seed gives the same pixels."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)  # [H, W, 3] uint8 → RGB


def png_bytes(img: Image.Image) -> bytes:
    """Lossless PNG encoding of `img`."""
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    """JPEG encoding of `img` (lossy: decoding gives close, not equal, pixels)."""
    buffer = io.BytesIO()
    img.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
