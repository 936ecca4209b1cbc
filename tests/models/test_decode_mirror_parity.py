"""The decode mirror (on by default on CPU) and the reference gather path (`decode_mirror=0`) give the
same logits, bit for bit, and the same tokens, through what moves rows around in the mirror: requests
joining mid-decode, finishing at different steps, chunked prefill next to decoding, speculative
steps in between, and the attention variants (sliding windows, soft-capping, bidirectional image
blocks, Llama4 chunked attention). The parity suites (text, VLM, speculation) compare the default
(mirror) path with transformers; this keeps the reference path tested and equal to it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

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


@pytest.mark.parametrize("arch", ARCHS)
def test_the_mirror_and_the_gather_path_give_identical_logits_and_tokens(arch):
    reference = run(load_engine(arch, decode_mirror=0.0), arch)
    mirrored_engine = load_engine(arch, decode_mirror=0.5)
    mirrored = run(mirrored_engine, arch)
    assert mirrored_engine.attention.mirror is not None and mirrored_engine.attention.mirror.nbytes > 0
    mirrored_engine.release_idle()  # what the service calls once it holds no batch
    assert mirrored_engine.attention.mirror is None
    assert_identical_runs(mirrored, reference)
    assert sorted(mirrored.tokens) == [0, 1, 2, 10, 11]


def test_speculative_steps_between_decode_steps_leave_the_mirror_exact():
    """With --speculate the n-gram drafter proposes only sometimes: a sequence alternates between
    one-token decode (mirror) and several query rows (paged), and rejected drafts' K/V are rewritten."""
    from tests.models.test_speculative import WITH_IMAGE

    reqs = lambda: [make_request(i, *WITH_IMAGE, max_new_tokens=14) for i in range(3)]  # noqa: E731
    out = {}
    for share in (0.0, 0.5):
        engine = load_engine("qwen2_vl", speculate=2, decode_mirror=share)
        runner = Runner(engine)
        runner.prefill(reqs())
        runner.run()
        out[share] = runner
    assert_identical_runs(out[0.5], out[0.0])
