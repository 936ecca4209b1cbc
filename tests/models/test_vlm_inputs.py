"""VLM request building: warmup's image, bad images and truncation through an image are refused
for the offending request only, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.layers.linear.kernels import mkl_serves_float32
from tgi_vlm.media import MediaKind
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_batch, make_request

IMG = png_bytes(make_test_image(20, 20, seed=1))
GOOD = ("Look at ", IMG, " and describe it")


@pytest.fixture(scope="module", params=VLM_ARCHS)
def arch(request):
    return request.param


def router_warmup(truncate: int = 40, max_total: int = 64, requests: int = 2) -> pb.WarmupRequest:
    """The shape TGI's v3 router sends: "_test " × truncate, a 20×20 PNG labelled jpeg after the first text."""
    return warmup_request(max_input_tokens=truncate, max_prefill_tokens=truncate * requests, max_total_tokens=max_total)


def test_router_shaped_warmup_succeeds(engine):
    supported, max_input, max_total = engine.warmup(router_warmup())
    assert (max_input, max_total) == (40, 64)
    assert supported == engine.kv_cache.num_blocks * engine.config.block_size


def test_warmup_on_cpu_builds_the_kernels_of_every_prefill_row_bucket(engine, monkeypatch):
    """After the warmup batch (which packs what it uses), oneDNN's kernels for every row bucket up to the
    prefill budget are built (layers/linear/plan.py `prime_packed_kernels`), not left to the first serving steps;
    MKL's float32 products build nothing and are not run (these engines are float32: oneDNN's where MKL does not serve)."""
    import tgi_vlm.models.warmup as warmup_module
    from tgi_vlm.layers.linear.kernels import row_buckets
    from tgi_vlm.layers.linear.plan import packed_products

    primed = []
    real = warmup_module.prime_packed_kernels
    monkeypatch.setattr(warmup_module, "prime_packed_kernels", lambda model, rows, **kw: primed.append(
        (model, rows, kw["row_caps"], real(model, rows, **kw))) or primed[-1][3])
    engine.warmup(router_warmup())
    padded = packed_products(engine.model)  # the packed kernels that build per row count, made by the warmup batch
    caps = {engine.lm_head: 256} if engine.lm_head is not None else {}
    assert (len(padded) == 0) == mkl_serves_float32()
    built = (len(padded) * len(row_buckets(80)), row_buckets(80)[-1]) if padded else (0, 0)
    assert primed == [(engine.model, 80, caps, built)]


def test_bf16_warmup_builds_the_kernels_of_every_prefill_row_bucket(monkeypatch):
    """The same in bf16, whose every packed product is oneDNN's; row counts a native bf16 product takes build no
    kernel (`builds_for`), so only oneDNN's are primed."""
    import tgi_vlm.models.warmup as warmup_module
    from tgi_vlm.layers.linear.kernels import can_pack_weights, row_buckets
    from tgi_vlm.layers.linear.plan import packed_products

    if not can_pack_weights(torch.bfloat16):
        pytest.skip("oneDNN cannot prepack bf16 weights on this CPU (needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)")

    engine = load_engine("qwen2_vl", dtype="bfloat16")
    primed = []
    real = warmup_module.prime_packed_kernels
    monkeypatch.setattr(warmup_module, "prime_packed_kernels", lambda model, rows, **kw: primed.append(
        real(model, rows, **kw)) or primed[-1])
    engine.warmup(router_warmup())
    products = packed_products(engine.model)
    assert products and all(kernel.pads_rows for kernel, _ in products)
    built = sum(1 for kernel, _ in products for rows in row_buckets(80) if kernel.builds_for(rows))
    assert built > 0  # the patch embedding's product has no native path
    assert primed == [(built, row_buckets(80)[-1])]


def bad_image_cases():
    corrupt = png_bytes(make_test_image(30, 30))[:60]
    return {
        "corrupt": (corrupt, "corrupt or truncated image"),
        "zero_bytes": (b"", "empty"),
        "not_an_image": (b"hello, I am text pretending to be an image", "cannot decode image"),
    }


@pytest.mark.parametrize("case", list(bad_image_cases()))
def test_bad_image_is_refused_naming_the_request_and_the_batch_goes_on(engine, arch, case):
    data, reason = bad_image_cases()[case]
    runner = Runner(engine)
    runner.prefill([make_request(0, *GOOD, max_new_tokens=5)])
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(2, [make_request(7, *GOOD), make_request(8, "bad ", data, " image")]))
    assert info.value.request_ids == [8]
    assert "request 8" in str(info.value) and reason in str(info.value)
    runner.prefill([make_request(7, *GOOD, max_new_tokens=4)], batch_id=2)  # the router resends the good one
    runner.run()
    assert_matches(runner, 0, hf_reference(arch, GOOD, 5))
    assert_matches(runner, 7, hf_reference(arch, GOOD, 4))
    assert engine.kv_blocks_in_use == 0 and engine.encoder_cache.num_entries == 0


def test_truncate_cutting_an_image_is_refused(engine):
    prompt = engine.tokenize_request(make_request(0, *GOOD))
    span = prompt.media[0]
    cut_inside = len(prompt.ids) - (span.offset + 1)  # keeps all but the image's first token
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(1, [make_request(3, *GOOD, truncate=cut_inside)]))
    assert info.value.request_ids == [3]
    assert "would cut image 0" in str(info.value)


def test_truncate_before_the_image_keeps_it(engine):
    prompt = engine.tokenize_request(make_request(0, *GOOD))
    keep = len(prompt.ids) - prompt.media[0].offset
    truncated = engine.tokenize_request(make_request(0, *GOOD, truncate=keep))
    assert truncated.ids == prompt.ids[-keep:]
    assert truncated.media[0].offset == 0


def test_truncate_after_the_image_drops_it(engine):
    prompt = engine.tokenize_request(make_request(0, *GOOD))
    keep = len(prompt.ids) - prompt.media[0].end  # the cut falls right after the image's last token
    truncated = engine.tokenize_request(make_request(0, *GOOD, truncate=keep))
    assert truncated.ids == prompt.ids[-keep:]
    assert truncated.media == []


def test_too_many_images_are_refused(arch):
    engine = load_engine(arch, limits=__import__("tgi_vlm.config", fromlist=["InputLimits"]).InputLimits(max_images_per_request=1))
    with pytest.raises(InvalidBatch, match="more than 1 images"):
        engine.batch_from_pb(make_batch(1, [make_request(5, "a ", IMG, " b ", IMG)]))


def test_text_only_model_refuses_an_image_but_ignores_it_in_warmup():
    engine = load_engine("llama")
    with pytest.raises(InvalidBatch, match="request 4: .*text-only"):
        engine.batch_from_pb(make_batch(1, [make_request(4, "hello ", IMG)]))
    assert engine.warmup(router_warmup())[1:] == (40, 64)


def test_warmup_whose_truncation_cuts_the_image_still_succeeds(engine):
    """The router sizes warmup from its own limits; an image its truncation cuts is left out."""
    supported, max_input, max_total = engine.warmup(router_warmup(truncate=3, max_total=16))
    assert (max_input, max_total) == (3, 16)
    engine.warmup(router_warmup())  # back to the module's usual limits


def test_add_special_tokens_false_is_passed_to_the_processor(engine, arch):
    """TGI's chat route sends add_special_tokens=false (the template already holds <bos>)."""
    text = engine.tokenizer.bos_token or ""
    chunks = (text + "Look at ", IMG, " and describe it")
    ours = engine.tokenize_request(make_request(0, *chunks, add_special_tokens=False)).ids
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(IMG)).convert("RGB")
    prompt = engine.adapter.prompt.build_prompt([chunks[0], MediaKind.IMAGE, chunks[2]])
    expected = engine.adapter.prompt.process(prompt, [image], add_special_tokens=False)["input_ids"][0].tolist()
    assert ours == expected
    if arch != "paligemma" and engine.tokenizer.bos_token_id is not None:
        assert ours.count(engine.tokenizer.bos_token_id) <= 1  # no double <bos>
