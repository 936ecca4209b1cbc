"""The decode mirror (the CPU path where the native kernel cannot run) and the reference gather path
(`decode_mirror=0`) give the same logits, bit for bit, and the same tokens, through what moves rows around in the mirror: requests
joining mid-decode, finishing at different steps, chunked prefill next to decoding, speculative
steps in between, and the attention variants (sliding windows, soft-capping, bidirectional image
blocks, Llama4 chunked attention). The native decode kernel (`tgi_vlm::decode_attention`, the CPU backend's
default where it loads) goes through the same scenarios against the gather path: the same tokens, logits within
float32 rounding (it sums in another order). The parity suites (text, VLM, speculation) compare the default
path with transformers; this keeps the other two tested and equal to it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.config import KernelSettings
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

NO_KERNEL = KernelSettings(native_attention=False)
IMG = png_bytes(make_test_image(40, 28, seed=3))
# gemma2: soft-capped logits and sliding windows; gemma3: bidirectional image blocks and sliding
# windows; llama4: chunked-attention layers; qwen2_vl: mrope; mistral: sliding window.
ARCHS = ("llama", "mistral", "gemma2", "qwen2_vl", "gemma3", "llama4")


def requests_for(arch: str, first_id: int, count: int):
    words = "the cat sat on a mat and looked at the dog who ran away from it".split()
    reqs = []
    for i in range(count):
        text = " ".join(words[: 4 + 3 * i])
        chunks = (text,) if arch in ("llama", "mistral", "gemma2") else ("Look ", IMG, " " + text)
        reqs.append(make_request(first_id + i, *chunks, max_new_tokens=6 + 4 * i))
    return reqs


def run(engine, arch: str) -> Runner:
    """Three requests; after two decode steps two more join with a small prefill budget, so their
    chunks run next to the others' decode rows; requests finish at different steps."""
    engine.prefill_budget = 7
    runner = Runner(engine)
    runner.prefill(requests_for(arch, 0, 3))
    while any(s.prefilling for s in runner.batch.seqs):
        runner.step()
    runner.step()
    runner.step()
    runner.prefill(requests_for(arch, 10, 2), batch_id=2)
    runner.run()
    return runner


def assert_identical_runs(ours: Runner, reference: Runner) -> None:
    """The same tokens for every request and the same logits at every step, bit for bit."""
    assert dict(ours.tokens) == dict(reference.tokens)
    for rid, rows in reference.logits.items():
        assert len(ours.logits[rid]) == len(rows)
        for mine, theirs in zip(ours.logits[rid], rows):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def _sdpa_sums_in_one_order() -> bool:
    """Whether torch's CPU SDPA kernel gave bit-equal results for the mirror's and the gather's key lengths where this
    was measured: on AVX-512 hosts (torch's CPU capability AVX512); on an AVX2-only host (AMD EPYC, torch 2.14.1) the
    padded lengths are summed in another order, ~5e-6 apart in float32 logits, the same tokens."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_mirror_and_the_gather_path_give_identical_logits_and_tokens(arch):
    reference = run(load_engine(arch, decode_mirror=0.0, kernels=NO_KERNEL), arch)
    mirrored_engine = load_engine(arch, decode_mirror=0.5, kernels=NO_KERNEL)
    mirrored = run(mirrored_engine, arch)
    assert mirrored_engine.attention.mirror is not None and mirrored_engine.attention.mirror.nbytes > 0
    mirrored_engine.release_idle()  # what the service calls once it holds no batch
    assert mirrored_engine.attention.mirror is None
    # A row copied to the wrong place or read past its length moves logits by far more than float32 rounding.
    (assert_identical_runs if _sdpa_sums_in_one_order() else assert_close_runs)(mirrored, reference)
    assert sorted(mirrored.tokens) == [0, 1, 2, 10, 11]


def assert_close_runs(ours: Runner, reference: Runner) -> None:
    """The same tokens for every request; logits within float32 rounding at every step."""
    assert dict(ours.tokens) == dict(reference.tokens)
    for rid, rows in reference.logits.items():
        assert len(ours.logits[rid]) == len(rows)
        for mine, theirs in zip(ours.logits[rid], rows):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-5)


needs_native = needs("decode_attention")


@needs_native
@pytest.mark.parametrize("arch", ARCHS)
def test_the_native_kernel_and_the_gather_path_agree(arch):
    require("decode_attention")
    reference = run(load_engine(arch, decode_mirror=0.0, kernels=NO_KERNEL), arch)
    engine = load_engine(arch, kernels=KernelSettings(native_attention=True))
    assert engine.attention.decode_kernel
    with op_calls() as calls:
        native = run(engine, arch)
    assert_close_runs(native, reference)
    assert sorted(native.tokens) == [0, 1, 2, 10, 11]
    if arch == "gemma2":  # soft-capped logits: the kernel steps aside after the first layer asks, the mirror decodes
        assert engine.attention.native_unsuitable and engine.attention.mirror is not None
    else:
        assert calls["tgi_vlm::decode_attention"] and not engine.attention.native_unsuitable
        assert engine.attention.mirror is None


def test_speculative_steps_between_decode_steps_leave_the_mirror_exact():
    """With --speculate the n-gram drafter proposes only sometimes: a sequence alternates between
    one-token decode (mirror) and several query rows (paged), and rejected drafts' K/V are rewritten."""
    from tests.models.test_speculative import WITH_IMAGE

    reqs = lambda: [make_request(i, *WITH_IMAGE, max_new_tokens=14) for i in range(3)]  # noqa: E731
    out = {}
    for share in (0.0, 0.5):
        engine = load_engine("qwen2_vl", speculate=2, decode_mirror=share, kernels=NO_KERNEL)
        runner = Runner(engine)
        runner.prefill(reqs())
        runner.run()
        out[share] = runner
    assert_identical_runs(out[0.5], out[0.0])


@needs_native
def test_speculative_steps_with_the_native_kernel_match_the_gather_path():
    from tests.models.test_speculative import WITH_IMAGE

    require("decode_attention")
    out = {}
    for native in (False, True):
        engine = load_engine("qwen2_vl", speculate=2, decode_mirror=0.0,
                             kernels=KernelSettings(native_attention=native))
        runner = Runner(engine)
        with op_calls() as calls:
            runner.prefill([make_request(i, *WITH_IMAGE, max_new_tokens=14) for i in range(3)])
            runner.run()
        out[native] = runner
    assert_close_runs(out[True], out[False])
    assert calls["tgi_vlm::decode_attention"]  # one-token steps between the speculative ones went through the kernel
