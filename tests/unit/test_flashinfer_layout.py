"""The flashinfer backend's host-side planning on CPU: a step's metadata as CSR page tables and the
flattened custom mask. The kernels themselves are checked in tests/gpu."""

from __future__ import annotations

import sys
import types

import torch

from tgi_vlm.layers.attention import AttentionMetadata, DecodeGroup, KVCacheSpec, PagedKVCache, PrefillSpan
from tgi_vlm.layers.attention.flashinfer_backend import build_layout, custom_mask, flashinfer_available

BS = 4


def _cache() -> PagedKVCache:
    return PagedKVCache(KVCacheSpec(1, 1, 2, BS, torch.float32), 16, "cpu")


def _slots(blocks: list[int], n: int) -> torch.Tensor:
    return torch.tensor([b * BS + j for b in blocks for j in range(BS)][:n])


def _mixed(groups: torch.Tensor | None = None) -> AttentionMetadata:
    """Rows: [decode seq A (kv 6, blocks 3,5)] [prefill B rows 1..3 (kv 3, block 7)] [decode C (kv 1, block 2)]."""
    a, c = _slots([3, 5], 6), _slots([2], 1)
    slot_index = torch.nn.utils.rnn.pad_sequence([a, c], batch_first=True)
    decode = DecodeGroup.build([0, 4], [6, 1], slot_index, num_tokens=5)
    span = PrefillSpan(q_start=1, q_end=4, kv_len=3, slot_index=_slots([7], 3), bidirectional_groups=groups)
    return AttentionMetadata(kv_cache=_cache(), slots=torch.zeros(5, dtype=torch.long),
                             decode=decode, prefills=[span])


def test_mixed_step_is_one_ragged_prefill_in_row_order():
    layout = build_layout(_mixed())
    assert not layout.decode_only
    assert layout.qo_indptr.tolist() == [0, 1, 4, 5]
    assert layout.kv_indptr.tolist() == [0, 2, 3, 4]
    assert layout.kv_indices.tolist() == [3, 5, 7, 2]
    assert layout.last_page_len.tolist() == [2, 3, 1]
    assert layout.spans == [("decode", 0), ("span", 0), ("decode", 1)]


def test_decode_only_step_plans_the_decode_wrapper_with_padding_rows_on_page_zero():
    slot_index = torch.stack([_slots([3, 5], 8), torch.zeros(8, dtype=torch.long)])
    decode = DecodeGroup.build([0, 1], [5, 1], slot_index, num_tokens=2)
    meta = AttentionMetadata(kv_cache=_cache(), slots=torch.zeros(2, dtype=torch.long),
                             decode=decode, prefills=[])
    layout = build_layout(meta)
    assert layout.decode_only
    assert layout.kv_indptr.tolist() == [0, 2, 3]
    assert layout.kv_indices.tolist() == [3, 5, 0]
    assert layout.last_page_len.tolist() == [1, 1]


def test_no_custom_mask_without_bidirectional_groups():
    meta = _mixed()
    assert custom_mask(meta, build_layout(meta), window_left=-1) is None


def test_custom_mask_concatenates_each_sequences_q_by_kv_mask():
    meta = _mixed(groups=torch.tensor([0, 0, -1]))  # B's first two positions form one image block
    mask = custom_mask(meta, build_layout(meta), window_left=-1)
    b = [[1, 1, 0], [1, 1, 0], [1, 1, 1]]  # position 0 sees position 1 (same block)
    expected = [1] * 6 + [v for row in b for v in row] + [1]
    assert mask.tolist() == [bool(v) for v in expected]


def test_custom_mask_applies_the_sliding_window_to_decode_rows():
    meta = _mixed(groups=torch.tensor([0, 0, -1]))
    mask = custom_mask(meta, build_layout(meta), window_left=1)  # window 2: a query sees itself and one back
    assert mask[:6].tolist() == [False] * 4 + [True, True]


def test_backend_is_absent_without_cuda_even_when_flashinfer_imports(monkeypatch):
    # An importable flashinfer (a stand-in here) is not enough: without CUDA the torch backend is used.
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flashinfer_available() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flashinfer_available() is True  # the same import with CUDA: the check above is what refused


def test_softcapped_layers_fall_back_to_the_torch_reference():
    """flashinfer plans no logit softcap, so a Gemma2 layer must not reach it (here: it would need CUDA)."""
    from tgi_vlm.layers.attention import FlashinferBackend, TorchPagedBackend

    def step():
        cache = PagedKVCache(KVCacheSpec(1, 1, 4, BS, torch.bfloat16), 16, "cpu")
        span = PrefillSpan(q_start=0, q_end=3, kv_len=3, slot_index=_slots([7], 3))
        return AttentionMetadata(kv_cache=cache, slots=_slots([7], 3), decode=None, prefills=[span])

    q, k, v = (torch.randn(1, h, 3, 4, generator=torch.Generator().manual_seed(h)).bfloat16() for h in (2, 1, 1))
    args = dict(scaling=0.5, sliding_window=None)
    ours = FlashinferBackend().forward(0, q, k, v, step(), softcap=1.0, **args)
    ref = TorchPagedBackend().forward(0, q, k, v, step(), softcap=1.0, **args)
    uncapped = TorchPagedBackend().forward(0, q, k, v, step(), **args)
    torch.testing.assert_close(ours, ref)
    assert not torch.allclose(ours, uncapped)
