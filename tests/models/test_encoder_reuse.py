"""The cross-request encoder cache: a repeated image skips the vision tower, with the same tokens."""

from __future__ import annotations

from tests.conftest import load_engine
from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

IMG = png_bytes(make_test_image(40, 28, seed=7))
FIRST = ("Look at ", IMG, " and describe it")
SECOND = ("Another question about ", IMG, " please")


def test_repeated_image_is_encoded_once_across_requests():
    engine = load_engine("qwen2_vl")
    encoded = []
    real_encode = engine.adapter.encode
    engine.adapter.encode = lambda kind, pixels: encoded.append(len(pixels)) or real_encode(kind, pixels)
    runner = Runner(engine)
    runner.prefill([make_request(0, *FIRST, max_new_tokens=4)])
    runner.run()
    runner.prefill([make_request(1, *SECOND, max_new_tokens=4)], batch_id=2)
    runner.run()
    assert encoded == [1]  # the second request reused the first one's vision output
    assert engine.encoder_cache.hits == 1
    assert_matches(runner, 0, hf_reference("qwen2_vl", FIRST, 4))
    assert_matches(runner, 1, hf_reference("qwen2_vl", SECOND, 4))
    assert engine.encoder_cache.num_entries == 0


def test_disabled_shared_cache_still_encodes_an_image_once_per_step():
    engine = load_engine("qwen2_vl", encoder_cache_bytes=0)
    encoded = []
    real_encode = engine.adapter.encode
    engine.adapter.encode = lambda kind, pixels: encoded.append(len(pixels)) or real_encode(kind, pixels)
    runner = Runner(engine)
    runner.prefill([make_request(0, *FIRST, max_new_tokens=2), make_request(1, *SECOND, max_new_tokens=2)])
    runner.run()
    assert encoded == [1]  # the same bytes in two requests of one step: one vision row set
    assert_matches(runner, 0, hf_reference("qwen2_vl", FIRST, 2))
    assert_matches(runner, 1, hf_reference("qwen2_vl", SECOND, 2))
