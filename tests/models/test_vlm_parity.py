"""For every architecture: greedy tokens identical to transformers' generate (request alone) and
per-step logits within 1e-4, with images anywhere, batching, chunked prefill through image spans,
joining and filtering; encoder entries and KV blocks back to zero after each scenario."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference, reference_model
from tgi_vlm.media import MediaKind
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes
from tgi_vlm.testing.harness import make_request

IMG_A = png_bytes(make_test_image(20, 20, seed=1))
IMG_B = png_bytes(make_test_image(37, 53, seed=2))
IMG_C = png_bytes(make_test_image(64, 30, seed=3))

ONE_IMAGE = ("Look at ", IMG_A, " and describe it")
TWO_IMAGES = ("First ", IMG_A, " then second ", IMG_B, " compare them")
IMAGE_FIRST = (IMG_C, " what is this")
BACK_TO_BACK = ("Two at once ", IMG_A, IMG_B, " done")
TEXT_ONLY = ("just some text without any picture at all",)


@pytest.fixture(scope="module", params=VLM_ARCHS)
def arch(request):
    return request.param


def check(runner, arch, request_id, chunks, n):
    assert_matches(runner, request_id, hf_reference(arch, chunks, n))


@pytest.mark.parametrize("chunks", [ONE_IMAGE, TWO_IMAGES, IMAGE_FIRST, BACK_TO_BACK], ids=["one", "two", "first", "back2back"])
def test_request_alone(runner, arch, chunks):
    runner.prefill([make_request(0, *chunks, max_new_tokens=6)])
    runner.run()
    check(runner, arch, 0, chunks, 6)


def test_text_only_request_batched_with_image_requests(runner, arch):
    prompts = [ONE_IMAGE, TEXT_ONLY, TWO_IMAGES]
    runner.prefill([make_request(i, *p, max_new_tokens=5 + i) for i, p in enumerate(prompts)])
    runner.run()
    for i, p in enumerate(prompts):
        check(runner, arch, i, p, 5 + i)


@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
def test_chunked_prefill_through_image_spans(engine, runner, arch, chunk):
    engine.prefill_budget = chunk
    runner.prefill([make_request(0, *TWO_IMAGES, max_new_tokens=5, chunk_len=chunk)])
    runner.run()
    check(runner, arch, 0, TWO_IMAGES, 5)


def test_chunk_boundary_exactly_at_span_edges(engine, runner, arch):
    """First chunk ends at the image span's start, the next exactly at its end (a Gemma3 image block
    too: a chunk ending where the block starts is not extended)."""
    prompt = engine.tokenize_request(make_request(0, *ONE_IMAGE))
    span = prompt.media[0]
    engine.prefill_budget = span.length
    runner.prefill([make_request(0, *ONE_IMAGE, max_new_tokens=4, chunk_len=span.offset)])
    seq = runner.batch.seqs[0]
    if arch == "paligemma":  # the image comes first and the whole prefix is one bidirectional block
        assert span.offset == 0 and seq.num_computed == seq.prompt_len
    else:
        assert seq.num_computed == span.offset
        runner.step()
        assert seq.num_computed == span.end
    runner.run()
    check(runner, arch, 0, ONE_IMAGE, 4)


def test_request_joins_mid_decode(runner, arch):
    runner.prefill([make_request(0, *ONE_IMAGE, max_new_tokens=8)])
    runner.step()
    runner.step()
    runner.prefill([make_request(1, *BACK_TO_BACK, max_new_tokens=5)], batch_id=2)
    runner.run()
    check(runner, arch, 0, ONE_IMAGE, 8)
    check(runner, arch, 1, BACK_TO_BACK, 5)


def test_filter_removes_request_with_half_prefilled_image(engine, runner, arch):
    prompt = engine.tokenize_request(make_request(1, *ONE_IMAGE))
    span = prompt.media[0]
    half = span.offset + max(1, span.length // 2)
    engine.prefill_budget = 2
    runner.prefill([make_request(0, *TWO_IMAGES, max_new_tokens=6), make_request(1, *ONE_IMAGE, max_new_tokens=6, chunk_len=half)])
    seq = runner.batch.seqs[1]
    if arch == "paligemma":
        assert seq.num_computed == seq.prompt_len  # its bidirectional prefix block is never split
    elif arch == "gemma3":
        assert seq.num_computed == span.end < seq.prompt_len  # the image block is kept whole, text continues
    else:
        assert span.offset < seq.num_computed < span.end  # the image is half prefilled
    # Request 0 was prefilled whole (its entries are gone); request 1 still holds its image's entry
    # unless its image block was computed whole.
    assert engine.encoder_cache.num_entries == (0 if arch in ("paligemma", "gemma3") else 1)
    runner.filter([0])
    assert engine.encoder_cache.num_entries == 0  # request 1's image entry went with it
    runner.run()
    check(runner, arch, 0, TWO_IMAGES, 6)


def test_placeholder_tokens_per_image_equal_the_processors(engine, arch):
    prompt = engine.tokenize_request(make_request(0, *TWO_IMAGES))
    _, _, adapter = reference_model(arch)
    text = adapter.build_prompt([c if isinstance(c, str) else MediaKind.IMAGE for c in TWO_IMAGES])
    images = [Image.open(io.BytesIO(c)).convert("RGB") for c in TWO_IMAGES if isinstance(c, bytes)]
    ids = adapter.process(text, images)["input_ids"][0].tolist()
    assert prompt.ids == ids
    assert sum(s.num_embed for s in prompt.media) == ids.count(adapter.media_token_id(MediaKind.IMAGE))


def test_images_encoded_together_equal_images_encoded_alone(engine):
    """Same-shaped images share one vision call; the split must give each image its own rows."""
    prompt = engine.tokenize_request(make_request(0, "a ", IMG_A, " b ", IMG_B, " c ", IMG_C, IMG_A))
    pixels = [s.pixel_inputs for s in prompt.media]
    together = engine.adapter.encode(MediaKind.IMAGE, pixels)
    alone = [engine.adapter.encode(MediaKind.IMAGE, [p])[0] for p in pixels]
    for span, t, a in zip(prompt.media, together, alone):
        assert t.shape == a.shape == (span.num_embed, t.shape[-1])
        assert (t - a).abs().max().item() < 1e-4
