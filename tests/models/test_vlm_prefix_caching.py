"""Prefix caching with images, every architecture: a multi-turn conversation resending the same
image reuses the cached blocks (skipping the vision tower for images wholly inside them) and gives
transformers' tokens; the same token ids with a different image never reuse the first image's
blocks; a prefix may end inside an image span except inside a bidirectional attention block."""

from __future__ import annotations

import pytest

from tests.models.prefix_routing import common_blocks
from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes
from tgi_vlm.testing.harness import make_batch

IMG = png_bytes(make_test_image(56, 56, seed=11))
OTHER_IMG = png_bytes(make_test_image(56, 56, seed=12))  # same size: the same placeholder ids
TURN1 = ("Look ", IMG, " and describe what you see in this picture, carefully and in detail please.")
TURN2 = (*TURN1, " Now list every color you noticed in it, one per line.")
BS = 16


@pytest.fixture(scope="module", params=VLM_ARCHS)
def arch(request):
    return request.param




@pytest.fixture
def encodes(engine, monkeypatch):
    calls: list[int] = []
    real = engine.adapter.encode
    monkeypatch.setattr(engine.adapter, "encode", lambda kind, pixels: calls.append(len(pixels)) or real(kind, pixels))
    return calls


def inside_group(engine, chunks, cache_len: int) -> bool:
    groups = engine.tokenize_request(routed_request_stub(chunks)).mm.group_ids
    return groups is not None and groups[cache_len - 1] >= 0 and groups[cache_len] == groups[cache_len - 1]


def routed_request_stub(chunks):
    from tgi_vlm.testing.harness import make_request

    return make_request(0, *chunks)


def usable_blocks(engine, routed, first, second) -> int:
    """Whole common blocks, stopping before a boundary inside a bidirectional block (a radix match
    in our driver stops there too; the shard refuses such a claim)."""
    k = common_blocks(routed.prompt_ids(first), routed.prompt_ids(second), BS)
    while k and inside_group(engine, second, k * BS):
        k -= 1
    return k


def run_first(runner, routed, chunks, n=3):
    request = routed.request(1, chunks, n)
    runner.prefill([request])
    runner.run()
    return list(request.blocks)


def refusal(engine, request) -> str:
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(9, [request]))
    return str(info.value)


def test_a_second_turn_reuses_the_first_turns_blocks_and_gives_transformers_tokens(
        engine, runner, routed, arch, encodes, computed):
    blocks = run_first(runner, routed, TURN1)
    k = usable_blocks(engine, routed, TURN1, TURN2)
    if arch == "paligemma":
        # Its whole prompt (image + text) is one bidirectional prefix: nothing before its end can be reused.
        assert k == 0
        return
    assert k >= 1
    span = engine.tokenize_request(routed_request_stub(TURN2)).media[0]
    encodes.clear()
    computed.clear()
    engine.encoder_cache.clear_shared()  # so that only the prefix can spare the vision tower
    runner.prefill([routed.request(2, TURN2, 5, prefix_blocks=blocks[:k], cache_len=k * BS)])
    assert computed == [len(routed.prompt_ids(TURN2)) - k * BS]  # only the uncached suffix went through the model
    runner.run()
    assert_matches(runner, 2, hf_reference(arch, TURN2, 5))
    assert (encodes == []) == (span.end <= k * BS)  # an image wholly inside the prefix is not encoded again


def test_the_same_token_ids_with_a_different_image_never_reuse_the_first_images_blocks(engine, runner, routed, arch):
    blocks = run_first(runner, routed, TURN1)
    twin = (TURN1[0], OTHER_IMG, TURN1[2])
    assert routed.prompt_ids(twin) == routed.prompt_ids(TURN1)  # a token-id radix tree would offer these blocks
    if arch == "paligemma":  # every block boundary lies inside its bidirectional prefix: refused for that first
        k, reason = common_blocks(routed.prompt_ids(TURN1), routed.prompt_ids(twin), BS), "bidirectional"
    else:  # a boundary outside any bidirectional block, after the image: only the image's content tells them apart
        k, reason = usable_blocks(engine, routed, TURN1, twin), "holds other content"
        assert engine.tokenize_request(routed_request_stub(twin)).media[0].end <= k * BS
    cache_len = min(k * BS, len(routed.prompt_ids(twin)) - 1)  # whole prompt found: TGI sends input_length - 1
    message = refusal(engine, routed.request(2, twin, 4, prefix_blocks=blocks[:k], cache_len=cache_len))
    assert "request 2" in message and reason in message, message
    runner.prefill([routed.request(3, twin, 5)])
    runner.run()
    assert_matches(runner, 3, hf_reference(arch, twin, 5))


def test_a_prefix_may_end_inside_an_image_span_unless_the_image_attends_both_ways(engine, runner, routed, arch,
                                                                                 computed):
    for pad in range(BS):
        head = ("a " * pad + "Look ", IMG, " and describe it.")
        span = engine.tokenize_request(routed_request_stub(head)).media[0]
        cut = (span.offset // BS + 1) * BS
        if span.offset < cut < span.end:
            break
    else:
        # PaliGemma puts its (here 4-token) image first whatever the text: no boundary falls inside it.
        # Any boundary lies inside its bidirectional prefix instead, which must be refused too.
        assert arch == "paligemma", "no block boundary falls inside the image span"
        cut = BS
    first, second = (*head, " The first question ends here."), (*head, " A second, different question.")
    blocks = run_first(runner, routed, first)
    request = routed.request(2, second, 4, prefix_blocks=blocks[: cut // BS], cache_len=cut)
    computed.clear()
    if inside_group(engine, second, cut):
        assert "bidirectional" in refusal(engine, request)
        return
    runner.prefill([request])
    assert computed == [len(routed.prompt_ids(second)) - cut]
    runner.run()
    assert_matches(runner, 2, hf_reference(arch, second, 4))


def test_info_never_offers_prefix_caching_for_a_vlm_even_when_the_launcher_asks(engine, monkeypatch):
    """TGI's router keys prefixes on token ids, blind to images (README, `cache_len` is verified)."""
    monkeypatch.setattr(engine, "config", engine.config.__class__(**{**engine.config.__dict__, "prefix_caching": True}))
    assert engine.info().use_prefix_caching is False
