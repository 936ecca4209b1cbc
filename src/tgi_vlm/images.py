"""Images: decoding untrusted bytes into RGB PIL images, and making deterministic ones.

The engine, the router and the tests all sit above this module.

The format is sniffed from the bytes (TGI's warmup sends a PNG labelled `image/jpeg`); the
mimetype is ignored. Limits guard against oversized payloads and decompression bombs: the
pixel count is checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageSequence, UnidentifiedImageError

from tgi_vlm.config import InputLimits


class ImageError(ValueError):
    """The bytes are not an acceptable image; the message says why."""


def decode_image(data: bytes, limits: InputLimits) -> Image.Image:
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {limits.max_image_bytes}")
    # PIL's process-wide guard (Image.MAX_IMAGE_PIXELS) is left as the process set it: our limit is
    # checked from the header first; PIL still refuses anything over twice its own limit.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise ImageError(
                    f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels} pixels"
                )
            if getattr(image, "is_animated", False):
                image = next(ImageSequence.Iterator(image))  # first frame of a GIF/APNG/WebP animation
            image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image is over the limit of {limits.max_image_pixels} pixels: {exc}") from None
    except UnidentifiedImageError as exc:
        raise ImageError(f"cannot decode image: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"corrupt or truncated image: {exc}") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Palette, alpha (composited on white), CMYK, 16-bit and grayscale images become 8-bit RGB."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda v: v / 256).convert("L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, (255, 255, 255))
        rgba = image.convert("RGBA")
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


# ----- deterministic images for workloads, demos and tests -----
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
