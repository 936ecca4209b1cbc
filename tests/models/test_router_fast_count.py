"""The router's shortcut for Qwen2-VL and Qwen2.5-VL prompts (image token counts from image sizes, no
pixel processing: `VlmPrompt.expanded_ids`) gives exactly what the processor gives: the same ids,
image spans, counts, truncation and refusals, over many image sizes, shapes and prompt layouts, and
with processor settings the shortcut must read (from the tokenizer's config) or must step aside for."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tgi_vlm.media import MediaKind
from tgi_vlm.router.tokens import CountError, TokenCounter
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import make_request


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def counters(request):
    path = str(tiny_model_path(request.param))
    return TokenCounter(path), TokenCounter(path, fast_count=False)


def outcome(counter: TokenCounter, request):
    try:
        return counter.tokenize(request), counter.count(request)
    except CountError as exc:
        return "refused", str(exc)


def layouts(first: bytes, second: bytes):
    return [
        (first,),  # an image at token 0
        ("Describe ", first, " briefly."),
        ("A ", first, second, " back to back"),
        ("<|vision_start|>", first, "<|vision_end|> spelled by the text"),
        ("the text names <|image_pad|> itself ", first),  # the processor decides: no shortcut
        ("a <|image_", "pad|> split over two chunks ", first),  # the joined prompt spells it: the processor refuses
        ("a <|video_pad|> token", first),
        ("no image at all",),
    ]


def test_the_shortcut_equals_the_processor_over_sizes_and_layouts(counters):
    fast, slow = counters
    rng = random.Random(0)
    sizes = [(1, 1), (28, 28), (27, 29), (56, 28), (448, 448), (600, 37), (13, 500), (1, 700), (900, 3)]
    sizes += [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(30)]
    refused = 0
    for k, (w, h) in enumerate(sizes):
        first = png_bytes(make_test_image(w, h, seed=k))
        second = png_bytes(make_test_image(h, w, seed=1000 + k))
        for j, chunks in enumerate(layouts(first, second)):
            request = make_request(k, *chunks)
            want = outcome(slow, request)
            assert outcome(fast, request) == want, (w, h, j)
            refused += want[0] == "refused"
    assert refused > 0  # the extreme aspect ratios are refused, the same way on both paths


def test_truncation_through_the_shortcut(counters):
    fast, slow = counters
    image = png_bytes(make_test_image(90, 60, seed=7))
    full = slow.tokenize(make_request(1, "Look at ", image, " and say what you see in it."))
    for keep in range(1, len(full.ids) + 3):
        request = make_request(1, "Look at ", image, " and say what you see in it.", truncate=keep)
        assert outcome(fast, request) == outcome(slow, request), keep


def test_the_shortcut_does_no_pixel_work(counters, monkeypatch):
    fast, slow = counters

    def no_pixels(*args, **kwargs):
        raise AssertionError("the image processor ran")

    monkeypatch.setattr(fast.processor.image_processor, "preprocess", no_pixels)
    request = make_request(3, "Describe ", png_bytes(make_test_image(120, 80, seed=3)), " briefly.")
    assert fast.tokenize(request) == slow.tokenize(request)
    assert fast.count(request) == slow.count(request)
    # a corrupt image is still refused by the router, with the shard's words
    bad = make_request(4, "Describe ", b"\x89PNG\r\n\x1a\nnot really", " briefly.")
    assert outcome(fast, bad) == outcome(slow, bad) and outcome(fast, bad)[0] == "refused"


def _variant(tmp_path, name: str, file: str, edit) -> str:
    """A copy of the tiny Qwen2-VL model with one JSON file of its processor edited."""
    path = tmp_path / name
    shutil.copytree(tiny_model_path("qwen2_vl"), path)
    config = json.loads((path / file).read_text())
    edit(config)
    (path / file).write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("name, file, edit, shortcut", [
    # merged into the image settings by the processor's call: the shortcut must read it too
    ("tokenizer-max-pixels", "tokenizer_config.json", lambda c: c.update(max_pixels=28 * 28 * 4), True),
    # the processor does not resize: sizes alone do not give the count the same way, so no shortcut
    ("no-resize", "processor_config.json", lambda c: c["image_processor"].update(do_resize=False), False),
])
def test_processor_settings_are_read_or_the_processor_is_kept(tmp_path, name, file, edit, shortcut):
    path = _variant(tmp_path, name, file, edit)
    fast, slow = TokenCounter(path), TokenCounter(path, fast_count=False)
    image = png_bytes(make_test_image(112, 84, seed=1))
    for k, chunks in enumerate([("Describe ", image, " briefly."), (image,), ("two: ", image, image)]):
        request = make_request(k, *chunks)
        assert outcome(fast, request) == outcome(slow, request)
    parts = ["Describe ", MediaKind.IMAGE, "."]
    from tgi_vlm.images import decode_image

    decoded = decode_image(image, fast.limits)
    assert (fast.prompt.expanded_ids(parts, [decoded]) is not None) == shortcut
    assert fast.fast_count == shortcut  # the start-up probe agreed with the processor (or found no shortcut)


def test_a_shortcut_that_disagrees_with_the_processor_is_not_used(counters, monkeypatch):
    fast, slow = counters
    assert fast.shortcut_agrees()
    real = type(fast.prompt).expanded_ids

    def one_token_short(self, parts, images, add_special_tokens=True):
        ids, counts = real(self, parts, images, add_special_tokens)
        return ids, [c - 1 for c in counts]

    monkeypatch.setattr(type(fast.prompt), "expanded_ids", one_token_short)
    assert not fast.shortcut_agrees()
