"""transformers' own generate as the reference the engine must match token for token."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    ids: list[int]
    logits: list[torch.Tensor]  # one [V] row per generated token


def hf_greedy(hf_model, inputs: dict, max_new_tokens: int) -> Reference:
    """Greedy generation of exactly `max_new_tokens` (EOS neither stops nor is masked) with per-step raw logits."""
    with torch.inference_mode():
        out = hf_model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            # like ignore_eos_token: never stop at EOS, but never mask it either (min_new_tokens would)
            eos_token_id=None,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
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
