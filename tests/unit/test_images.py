"""Image decoding: sniffed format, limits, conversion of every mode to RGB."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from PIL import Image, ImageFile

from tgi_vlm.config import InputLimits
from tgi_vlm.images import ImageError, decode_image
from tgi_vlm.media import MediaKind
from tgi_vlm.models.vlm_intake import prompt_parts
from tgi_vlm.testing.harness import make_request

LIMITS = InputLimits()
# What prompt_parts asks of the architecture: only whether it takes the kind.
PROMPT_TAKING_IMAGES = SimpleNamespace(require=lambda kind: None)


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


@pytest.mark.parametrize(("fmt", "label"), [("PNG", "image/jpeg;base64"), ("JPEG", "image/png"), ("PNG", "text/plain")])
def test_the_format_is_sniffed_and_the_mimetype_label_ignored(fmt, label):
    """TGI's warmup sends a PNG labelled image/jpeg: the request's label must not decide the decoder."""
    data = encode(Image.new("RGB", (20, 12), (200, 10, 10)), fmt)
    request = make_request(1, "see ", data, mimetype=label)
    assert request.input_chunks.chunks[1].image.mimetype == label
    parts, images, _ = prompt_parts(PROMPT_TAKING_IMAGES, request, LIMITS)
    assert parts == ["see ", MediaKind.IMAGE] and images[0].size == (20, 12)


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


def test_pixel_limit_is_checked_from_the_header_before_decoding(monkeypatch):
    # 4000×4000 = 16M pixels: over our limit here but under PIL's own bomb guard (~89M warns, ~179M
    # refuses), so only our header check can refuse it.
    bomb = encode(Image.new("1", (4000, 4000)))
    assert len(bomb) < 100_000
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("pixels were decoded before the check"))
    with pytest.raises(ImageError, match=r"^image is 4000x4000 = 16000000 pixels, over the limit of 1000000 pixels$"):
        decode_image(bomb, InputLimits(max_image_pixels=1_000_000))


def test_pils_own_bomb_guard_still_refuses_above_twice_its_default_whatever_our_limit():
    bomb = encode(Image.new("1", (20_000, 20_000)))  # 400M pixels > 2 × Image.MAX_IMAGE_PIXELS (~179M)
    with pytest.raises(ImageError, match="over the limit of 1000000000 pixels: Image size"):
        decode_image(bomb, InputLimits(max_image_pixels=10**9))


def test_byte_limit():
    with pytest.raises(ImageError, match="bytes, over the limit of 10"):
        decode_image(encode(Image.new("RGB", (8, 8))), InputLimits(max_image_bytes=10))
