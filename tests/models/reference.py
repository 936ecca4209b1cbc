"""transformers' own generate as the reference the engine must match token for token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList


@dataclass
class Reference:
    ids: list[int]
    logits: list[torch.Tensor]  # one [V] row per generated token


class ForceTokens(LogitsProcessor):
    """Makes generate emit `tokens` in order; the raw logits it reports are still the model's own."""

    def __init__(self, tokens: list[int], prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_len]] = 0
        return forced


def hf_greedy(hf_model, inputs: dict, max_new_tokens: int, forced: list[int] | None = None) -> Reference:
    """Greedy generation of exactly `max_new_tokens` (EOS neither stops nor is masked) with per-step raw logits.
    `forced`: emit these tokens instead (teacher forcing), to read the model's logits along another run's path."""
    processors = LogitsProcessorList([ForceTokens(forced, inputs["input_ids"].shape[1])] if forced else [])
    with torch.inference_mode():
        out = hf_model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            # like ignore_eos_token: never stop at EOS, but never mask it either (min_new_tokens would)
            eos_token_id=None,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=processors,
        )
    prompt_len = inputs["input_ids"].shape[1]
    return Reference(ids=out.sequences[0, prompt_len:].tolist(), logits=[step[0].float() for step in out.logits])


def assert_matches(runner, request_id: int, ref: Reference, atol: float = 1e-4) -> None:
    got = runner.tokens[request_id]
    assert got == ref.ids, f"request {request_id}: tokens {got} != transformers {ref.ids}"
    ours = runner.logits[request_id]
    assert len(ours) == len(ref.logits)
    for step, (a, b) in enumerate(zip(ours, ref.logits)):
        v = min(a.shape[-1], b.shape[-1])
        diff = (a[:v] - b[:v]).abs().max().item()
        assert diff <= atol, f"request {request_id} step {step}: logits differ by {diff:.2e}"


# bfloat16 keeps 8 significant bits: at |logit| in [8, 16), where these tiny models' top logits lie, one step is
# 1/16. Running in a batch instead of alone moved the engine's bf16 logits by up to 2 steps (0.125) on this
# project's CPU, so two logits each moved by that much can trade places when they were within 0.25.
BF16_TIE = 0.25
BF16_LOGIT_ATOL = 0.25


@dataclass
class NearTie:
    """A step where the engine's bf16 token is not transformers' bf16 argmax (both given the engine's earlier tokens)."""

    step: int
    ours: int
    theirs: int
    margin: float  # transformers' top-1 minus top-2 logit at that step
    gap: float  # transformers' top-1 logit minus its logit for our token (= margin when ours is its runner-up)


def bf16_near_ties(got: list[int], along: Reference, tolerance: float = BF16_TIE) -> list[NearTie]:
    """Every step where `got` differs from transformers' argmax; `along` holds transformers' logits along `got`
    (hf_greedy with forced=got). Fails unless each such step is a near tie: our token within `tolerance` of
    transformers' top logit."""
    assert along.ids == got and len(along.logits) == len(got)
    ties = []
    for step, (token, logits) in enumerate(zip(got, along.logits)):
        top2 = logits.topk(2)
        theirs = int(logits.argmax())  # as greedy generate picks: the first of equal maxima (topk may not be)
        if token != theirs:
            gap = float(top2.values[0] - logits[token])
            tie = NearTie(step, token, theirs, float(top2.values[0] - top2.values[1]), gap)
            assert gap <= tolerance, f"not a bf16 near tie: {tie} (tolerance {tolerance})"
            ties.append(tie)
    return ties


def assert_logits_close(got: list[torch.Tensor], ref: Reference, atol: float, what: str) -> float:
    """Per-step logits within `atol`; returns the largest difference."""
    assert len(got) == len(ref.logits), what
    worst = 0.0
    for step, (a, b) in enumerate(zip(got, ref.logits)):
        v = min(a.shape[-1], b.shape[-1])
        diff = (a[:v].float() - b[:v].float()).abs().max().item()
        assert diff <= atol, f"{what} step {step}: logits differ by {diff:.3g} > {atol}"
        worst = max(worst, diff)
    return worst
