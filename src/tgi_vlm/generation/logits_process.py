"""Per-request logits processors.

Applied in TGI's order: watermark, repetition penalty, frequency penalty, the grammar's allowed
tokens, logit bias, then the warpers temperature, top-k, top-p, typical-p. Each function takes
`scores` [V] or [B, V] (rows that share these settings) and returns a new tensor; the caller's
logits are never modified in place.
`history` is the request's token ids so far (prompt + generated), [L] or [B, L].
The warpers reproduce transformers' `*LogitsWarper` classes (filter value -inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Kirchenbauer et al.'s prime: the green list of step t is seeded by HASH_KEY × token[t-1].
WATERMARK_HASH_KEY = 15485863
_FILTERED = -math.inf


def _rows_like(history: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    if history.dim() < scores.dim():
        return history.expand(*scores.shape[:-1], history.shape[-1])
    return history


def apply_repetition_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """Seen tokens: negative logits × penalty, others ÷ penalty (CTRL / transformers semantics)."""
    history = _rows_like(history, scores)
    seen = scores.gather(-1, history)
    penalized = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(-1, history, penalized)


def apply_frequency_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """TGI's formula: subtract penalty × (count of the token in history / len(history))."""
    history = _rows_like(history, scores)
    ones = torch.ones_like(history, dtype=scores.dtype)
    counts = torch.zeros_like(scores).scatter_add_(-1, history, ones)
    return scores - counts / history.shape[-1] * penalty


class Watermark:
    """Green-list watermark (TGI's `WatermarkLogitsProcessor`): add `delta` to a gamma·V subset."""

    def __init__(self, gamma: float, delta: float, device: torch.device | str) -> None:
        self.gamma = gamma
        self.delta = delta
        self.generator = torch.Generator(device=device)

    def greenlist(self, prev_token: int, vocab_size: int) -> torch.Tensor:
        self.generator.manual_seed(WATERMARK_HASH_KEY * prev_token)
        permutation = torch.randperm(vocab_size, generator=self.generator, device=self.generator.device)
        return permutation[: int(vocab_size * self.gamma)]

    def __call__(self, scores: torch.Tensor, prev_token: int) -> torch.Tensor:
        green = self.greenlist(prev_token, scores.shape[-1]).to(scores.device)
        boosted = scores.clone()
        boosted[..., green] += self.delta
        return boosted


class LogitBias:
    """Per-token additive bias (TGI's `LogitBiasProcessor`, OpenAI's `logit_bias`): scores[id] += bias.

    Built once per request from (token id, bias) pairs; ids repeated in `pairs` add up.
    """

    def __init__(self, pairs: Sequence[tuple[int, float]], device: torch.device | str) -> None:
        self.ids = torch.tensor([token for token, _ in pairs], dtype=torch.long, device=device)
        self.values = torch.tensor([bias for _, bias in pairs], dtype=torch.float32, device=device)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        values = self.values.to(scores.dtype).expand(*scores.shape[:-1], -1)  # one copy per row
        return scores.index_add(-1, self.ids, values)


def apply_temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    return scores / temperature


def apply_top_k(scores: torch.Tensor, top_k: int, min_tokens_to_keep: int = 1) -> torch.Tensor:
    k = min(max(top_k, min_tokens_to_keep), scores.shape[-1])
    kth_best = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth_best, _FILTERED)


def apply_top_p(scores: torch.Tensor, top_p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -min_tokens_to_keep:] = False
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), _FILTERED)


def apply_typical_p(scores: torch.Tensor, mass: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    logp = torch.log_softmax(scores, dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    # Rank tokens by how far their surprise is from the expected surprise (the entropy).
    gap, order = torch.sort((-logp - entropy).abs(), dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)
    drop_sorted = gap > gap.gather(-1, last)
    drop_sorted[..., :min_tokens_to_keep] = False
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), _FILTERED)


@dataclass
class LogitsPipeline:
    """One request's processors; neutral values (1.0 / 0) mean the step is skipped."""

    watermark: Watermark | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    logit_bias: LogitBias | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0

    @property
    def needs_history(self) -> bool:
        return self.watermark is not None or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0

    @property
    def is_identity(self) -> bool:
        return not self.needs_history and self.logit_bias is None and not self.has_warpers

    @property
    def has_warpers(self) -> bool:
        return self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0

    def __call__(self, scores: torch.Tensor, history: Sequence[int] = (),
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
        """scores [V] or [B, V] → processed scores of the same shape (a new tensor).
        `allowed` (bool, same shape): a grammar's tokens; the rest become -inf after the penalties
        and before the warpers, TGI's order."""
        if self.needs_history:
            if len(history) == 0:
                raise ValueError("penalties and watermarking need at least one token of history")
            scores = self._penalize(scores, history)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, _FILTERED)
        if self.logit_bias is not None:
            scores = self.logit_bias(scores)
        return self._warp(scores)

    def _penalize(self, scores: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        if self.watermark is not None:
            scores = self.watermark(scores, int(history[-1]))
        if self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0:
            return scores
        ids = torch.as_tensor(history, dtype=torch.long, device=scores.device)
        if self.repetition_penalty != 1.0:
            scores = apply_repetition_penalty(scores, ids, self.repetition_penalty)
        if self.frequency_penalty != 0.0:
            scores = apply_frequency_penalty(scores, ids, self.frequency_penalty)
        return scores

    def _warp(self, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature != 1.0:
            scores = apply_temperature(scores, self.temperature)
        if self.top_k != 0:
            scores = apply_top_k(scores, self.top_k)
        if self.top_p < 1.0:
            scores = apply_top_p(scores, self.top_p)
        if self.typical_p < 1.0:
            scores = apply_typical_p(scores, self.typical_p)
        return scores
