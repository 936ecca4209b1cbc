"""Comparisons between the ranks' traces, the unsharded engine's and transformers' generate."""

from __future__ import annotations

import numpy as np
import torch

from tests.distributed.scenarios import Trace
from tests.models.reference import Reference

ATOL = 1e-4  # float32 logits: sharded sums (all-reduce of partial matmuls) differ in rounding only


def assert_ranks_agree_with_single(sharded: list[Trace], single: Trace) -> None:
    """Every rank chose the same tokens from bit-identical logits (the lm-head gather gives each the
    full row), and those are the unsharded engine's tokens with logits within ATOL."""
    first, *others = sharded
    for rank, trace in enumerate(others, start=1):
        assert trace.tokens == first.tokens, f"rank {rank} chose other tokens than rank 0"
        assert trace.refusals == first.refusals, f"rank {rank} refused differently from rank 0"
        for rid, rows in first.logits.items():
            assert np.array_equal(trace.logits[rid], rows), f"rank {rank}: request {rid}'s logits differ from rank 0's"
    assert first.tokens == single.tokens, f"sharded tokens {first.tokens} != unsharded {single.tokens}"
    assert first.logits.keys() == single.logits.keys()
    for rid, rows in first.logits.items():
        assert rows.shape == single.logits[rid].shape
        diff = float(np.abs(rows - single.logits[rid]).max())
        assert diff <= ATOL, f"request {rid}: sharded logits differ from unsharded by {diff:.2e}"
    for rank, trace in enumerate(sharded):
        assert (trace.kv_blocks_in_use, trace.encoder_entries) == (0, 0), f"rank {rank} leaked blocks or entries"


def assert_matches_transformers(trace: Trace, rid: int, ref: Reference) -> None:
    assert trace.tokens[rid] == ref.ids, f"request {rid}: tokens {trace.tokens[rid]} != transformers {ref.ids}"
    ours = torch.from_numpy(trace.logits[rid])
    for step, theirs in enumerate(ref.logits):
        v = min(ours.shape[-1], theirs.shape[-1])
        diff = (ours[step, :v] - theirs[:v]).abs().max().item()
        assert diff <= ATOL, f"request {rid} step {step}: logits differ from transformers' by {diff:.2e}"
