"""bfloat16, the default dtype on a CPU with native bf16 (tgi_vlm.dtypes): for every architecture the engine in
bfloat16, serving one batch (two requests with images and a text-only one; text models: prompts of different
lengths), emits transformers' own bfloat16 greedy `generate` tokens for each request run alone.

A token may differ only at a bf16 near tie, with the reason shown: transformers' logits are read along the
engine's tokens (teacher forcing), and at a differing step the engine's token must be within BF16_TIE of
transformers' top logit; the tie (step, both tokens, top-2 margin) is printed and recorded in the test
report. Logits along the engine's path are within BF16_LOGIT_ATOL. The float32 parity of test_vlm_parity.py
and test_text_parity.py (token-exact, logits within 1e-4) runs with float32 pinned.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import load_engine
from tests.models.reference import BF16_LOGIT_ATOL, Reference, assert_logits_close, bf16_near_ties, hf_greedy
from tests.models.vlm_reference import hf_reference
from tgi_vlm.testing import TEXT_ARCHS, VLM_ARCHS, make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import make_request

N = 8
IMG_A = png_bytes(make_test_image(20, 20, seed=1))
IMG_B = png_bytes(make_test_image(37, 53, seed=2))
VLM_PROMPTS = [("Look at ", IMG_A, " and describe it"), ("just some text without any picture at all",),
               ("First ", IMG_A, " then second ", IMG_B, " compare them")]
TEXT_PROMPTS = [("hello world this is",), ("the quick brown fox jumps over the lazy dog and then some more",),
                ("numbers 1 2 3 and 4",)]


@pytest.fixture(params=VLM_ARCHS + TEXT_ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def engine(arch):
    """Overrides the parity modules' float32 engine (tests/models/conftest.py); `runner` drives this one."""
    return load_engine(arch, dtype="bfloat16")


def text_reference(arch: str):
    path = tiny_model_path(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def reference(chunks: tuple, n: int, forced: list[int] | None = None) -> Reference:
        return hf_greedy(model, dict(tokenizer(chunks[0], return_tensors="pt")), n, forced)

    return reference


def test_bf16_batch_gives_transformers_bf16_greedy_tokens(engine, runner, arch, record_property):
    assert engine.dtype == torch.bfloat16
    is_vlm = arch in VLM_ARCHS
    prompts = VLM_PROMPTS if is_vlm else TEXT_PROMPTS
    reference = ((lambda chunks, n, forced=None: hf_reference(arch, chunks, n, torch.bfloat16, forced)) if is_vlm
                 else text_reference(arch))
    runner.prefill([make_request(i, *p, max_new_tokens=N) for i, p in enumerate(prompts)])
    runner.run()
    ties = {}
    for i, chunks in enumerate(prompts):
        got = runner.tokens[i]
        alone = reference(chunks, N)
        assert len(got) == N
        # Equal tokens: transformers' own greedy run is the path. Otherwise its logits along ours.
        along = alone if got == alone.ids else reference(chunks, N, forced=got)
        assert_logits_close(runner.logits[i], along, BF16_LOGIT_ATOL, f"{arch} request {i}")
        found = bf16_near_ties(got, along)
        assert bool(found) == (got != alone.ids), (got, alone.ids, found)  # a difference starts at a tie
        if found:
            ties[i] = [dataclasses.asdict(t) for t in found]
            print(f"{arch} request {i}: bf16 near ties {found}; engine {got}, transformers alone {alone.ids}")
    record_property("bf16_near_ties", ties)
