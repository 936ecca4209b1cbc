"""Log-probabilities reported to the client: top-n alternatives and prompt-token logprobs."""

from __future__ import annotations

import torch

# Rows of prompt logits upcast at a time; bounds the float32 copy at CHUNK × V.
_PREFILL_CHUNK_ROWS = 512


def top_n(logprob_row: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """The n most likely ids of one row [V], best first.

    Exactly n (clamped to V) are returned; among equal logprobs the lower id comes first (a stable
    sort), unlike TGI, which returns every token tied with the n-th.
    """
    n = min(max(n, 0), logprob_row.shape[-1])
    if n == 0:
        return [], []
    values, ids = torch.sort(logprob_row, descending=True, stable=True)
    return ids[:n].tolist(), values[:n].tolist()


def prefill_logprobs(logits: torch.Tensor, next_ids: list[int]) -> list[float]:
    """logits [T, V] (raw, no processors, as TGI) → log_softmax(logits)[t, next_ids[t]] for t < len(next_ids)."""
    if len(next_ids) > logits.shape[0]:
        raise ValueError(f"prefill_logprobs got {len(next_ids)} next ids for {logits.shape[0]} logits rows")
    ids = torch.as_tensor(next_ids, dtype=torch.long, device=logits.device)
    out = []
    for start in range(0, len(next_ids), _PREFILL_CHUNK_ROWS):
        rows = logits[start : start + _PREFILL_CHUNK_ROWS].float()[: len(next_ids) - start]
        chosen = rows.gather(-1, ids[start : start + rows.shape[0], None]).squeeze(-1)
        out.append(chosen - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).tolist() if out else []
