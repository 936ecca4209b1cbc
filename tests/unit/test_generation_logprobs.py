"""top_n is the true top-n; prefill_logprobs is log_softmax of raw logits at the next prompt ids."""

import pytest
import torch

from tgi_vlm.generation.logprobs import prefill_logprobs, top_n


def test_top_n_equals_torch_topk() -> None:
    row = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), -1)
    ids, logprobs = top_n(row, 7)
    expected = torch.topk(row, 7)
    assert ids == expected.indices.tolist()
    assert logprobs == expected.values.tolist()


def test_top_n_ties_put_the_lower_id_first_and_return_exactly_n() -> None:
    row = torch.tensor([-1.0, -0.5, -1.0, -0.5, -3.0])
    assert top_n(row, 3) == ([1, 3, 0], [-0.5, -0.5, -1.0])


def test_top_n_is_clamped_to_the_vocabulary_and_zero_is_empty() -> None:
    row = torch.tensor([-2.0, -1.0])
    assert top_n(row, 10)[0] == [1, 0]
    assert top_n(row, 0) == ([], [])


def test_prefill_logprobs_are_raw_log_softmax_at_next_ids() -> None:
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(1))
    next_ids = [3, 0, 10, 5, 5, 1]
    expected = torch.log_softmax(logits, -1)[torch.arange(6), torch.tensor(next_ids)]
    assert prefill_logprobs(logits, next_ids) == pytest.approx(expected.tolist(), abs=1e-6)


def test_prefill_logprobs_work_across_chunks_and_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    import tgi_vlm.generation.logprobs as module

    monkeypatch.setattr(module, "_PREFILL_CHUNK_ROWS", 4)
    logits = torch.randn(10, 11, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    next_ids = list(range(9))  # the last row has no next prompt token
    expected = torch.log_softmax(logits.float(), -1)[torch.arange(9), torch.tensor(next_ids)]
    assert prefill_logprobs(logits, next_ids) == pytest.approx(expected.tolist(), abs=1e-6)


def test_prefill_logprobs_reject_more_ids_than_rows() -> None:
    with pytest.raises(ValueError, match="3 next ids for 2 logits rows"):
        prefill_logprobs(torch.zeros(2, 5), [1, 2, 3])
