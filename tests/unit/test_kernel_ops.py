"""The native CPU kernels as torch ops (kernels/cpu/ops.py): registered under their names with the mutations they
make and fake implementations for tracing; each refuses, at its own entry, an index outside its tensors (a slot one
past the cache, a negative one, rows and positions outside the query and the slot index), before any C runs, and
takes exactly the last valid slot; the rotary + K/V store is bit-equal to torch's operations."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.unit.kernels_here import needs, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.attention.kv_cache import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.torch_backend import write_kv
from tgi_vlm.layers.cpu_decoder import _rotate

SLOTS = 48  # every test cache: slots 0..47
HQ, HKV, D = 4, 2, 16


def test_the_ops_are_registered_in_the_tgi_vlm_namespace_with_the_tensors_they_mutate():
    mutated = {name: [a.name for a in getattr(torch.ops.tgi_vlm, name).default._schema.arguments
                      if a.alias_info is not None and a.alias_info.is_write]
               for name in ("decode_attention", "rotary_and_store", "rms_norm", "gemma_rms_norm", "skinny_linear",
                            "skinny_linear_bf16", "greedy_logsumexp", "grouped_int8_linear", "grouped_int8_dequantize")}
    assert mutated == {"decode_attention": ["out"], "rotary_and_store": ["k_cache", "v_cache"], "rms_norm": [],
                       "gemma_rms_norm": ["out"], "skinny_linear": [], "skinny_linear_bf16": [],
                       "greedy_logsumexp": [], "grouped_int8_linear": [], "grouped_int8_dequantize": []}


def test_fake_implementations_give_the_output_shapes_without_running_anything():
    with FakeTensorMode():
        q, k = ops.rotary_and_store(torch.empty(1, 5, (HQ + 2 * HKV) * D), torch.empty(1, 5, D), torch.empty(1, 5, D),
                                    HQ, torch.empty(SLOTS, HKV, D), torch.empty(SLOTS, HKV, D),
                                    torch.zeros(5, dtype=torch.long))
        normed = ops.rms_norm(torch.empty(1, 5, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16), 1e-5)
        product = ops.skinny_linear(torch.empty(3, 64), torch.empty(2, 64, 16), 20, None)
        grouped = ops.grouped_int8_linear(torch.empty(3, 64, dtype=torch.bfloat16), torch.empty(20, 64, dtype=torch.int8),
                                          torch.empty(20, 2), None, 32)
        dense = ops.grouped_int8_dequantize(torch.empty(20, 64, dtype=torch.int8), torch.empty(20, 2), None, 32,
                                            torch.bfloat16)
        q_dec = torch.empty(3, HQ, D)
        out = ops.decode_attention(q_dec, torch.empty_like(q_dec), torch.empty(SLOTS, HKV, D),
                                   torch.empty(SLOTS, HKV, D), torch.zeros(2, 4, dtype=torch.long),
                                   torch.zeros(3, 2, dtype=torch.long), 0.25)
    assert (q.shape, k.shape) == ((5, HQ, D), (5, HKV, D))
    assert normed.shape == (1, 5, 64) and normed.dtype == torch.bfloat16
    assert product.shape == (3, 20) and out is None
    assert grouped.shape == (3, 20) and grouped.dtype == torch.bfloat16
    assert dense.shape == (20, 64) and dense.dtype == torch.bfloat16


# ----- rotary + K/V store -----

def _rotary_inputs(tokens: int = 2):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(1, tokens, (HQ + 2 * HKV) * D, generator=gen)
    angles = torch.rand(1, tokens, D, generator=gen) * 20
    return qkv, angles.cos(), angles.sin(), torch.zeros(SLOTS, HKV, D), torch.zeros(SLOTS, HKV, D)


@pytest.mark.parametrize("tokens", [2, 300], ids=["decode-sized", "prefill-sized"])  # both ways of finding the bound
@pytest.mark.parametrize("slot", [SLOTS, -1], ids=["one-past-the-cache", "negative"])
def test_rotary_and_store_refuses_a_slot_outside_the_cache_and_writes_nothing(slot, tokens):
    qkv, cos, sin, k_cache, v_cache = _rotary_inputs(tokens)
    slots = torch.arange(tokens) % SLOTS
    slots[tokens // 2] = slot
    with pytest.raises(ValueError, match="rotary_and_store: a slot past the cache of 48 slots, or negative"):
        ops.rotary_and_store(qkv, cos, sin, HQ, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()


@needs("rotary_and_store")
def test_rotary_and_store_writes_the_last_slot_of_the_cache():
    require("rotary_and_store")
    qkv, cos, sin, k_cache, v_cache = _rotary_inputs()
    _, key = ops.rotary_and_store(qkv, cos, sin, HQ, k_cache, v_cache, torch.tensor([3, SLOTS - 1]))
    assert torch.equal(k_cache[SLOTS - 1], key[1]) and torch.equal(v_cache[SLOTS - 1], qkv[0, 1, -HKV * D:].view(HKV, D))
    assert torch.equal(k_cache[3], key[0]) and not k_cache[4 : SLOTS - 1].any()


def test_rotary_and_store_refuses_slots_that_are_not_one_per_row_and_heads_that_do_not_fill_the_product():
    qkv, cos, sin, k_cache, v_cache = _rotary_inputs()
    with pytest.raises(ValueError, match=r"\(3,\) torch.int64 slots for 2 rows"):
        ops.rotary_and_store(qkv, cos, sin, HQ, k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="does not hold 3 \\+ 2 x 2 heads of 16"):
        ops.rotary_and_store(qkv, cos, sin, 3, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must be \\[slots, Hkv, D\\] contiguous"):  # values laid out otherwise
        ops.rotary_and_store(qkv, cos, sin, HQ, k_cache, torch.zeros(SLOTS, D, HKV).transpose(1, 2), torch.tensor([0, 1]))
    assert not ops.can_rotate(qkv, cos, sin, HQ, k_cache, k_cache.to(torch.bfloat16))


@needs("rotary_and_store")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hkv,head_dim", [(13, 12, 4, 64), (300, 12, 2, 128), (5, 4, 2, 16), (1, 3, 1, 8)])
def test_rotary_and_store_is_bit_equal_to_the_torch_operations(dtype, tokens, hq, hkv, head_dim):
    """The lean layer's fused rotary + K/V store against its torch form (`_rotate`, then `write_kv`): the same
    bits in the query, the key, and every cache slot (written or not)."""
    require("rotary_and_store")
    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = (torch.randn(1, tokens, (hq + 2 * hkv) * head_dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(1, tokens, head_dim, generator=gen) * 20
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [PagedKVCache(KVCacheSpec(1, hkv, head_dim, 16, dtype), tokens // 16 + 4, "cpu") for _ in range(2)]
    slots = torch.randperm(caches[0].num_slots - 16, generator=gen)[:tokens] + 16

    qk = _rotate(qkv[..., : (hq + hkv) * head_dim].view(1, tokens, hq + hkv, head_dim), cos.unsqueeze(2),
                 sin.unsqueeze(2))
    query, key = qk[0, :, :hq], qk[0, :, hq:]
    value = qkv[..., (hq + hkv) * head_dim :].view(1, tokens, hkv, head_dim).transpose(1, 2)
    write_kv(*caches[0].flat(0), key.transpose(0, 1)[None], value, slots)

    assert ops.can_rotate(qkv, cos, sin, hq, *caches[1].flat(0))
    got_q, got_k = ops.rotary_and_store(qkv, cos, sin, hq, *caches[1].flat(0), slots)
    assert torch.equal(got_q, query) and torch.equal(got_k, key)
    assert torch.equal(caches[1].keys[0], caches[0].keys[0]) and torch.equal(caches[1].values[0], caches[0].values[0])


# ----- decode attention -----

def _decode_inputs(last_slot: int):
    """Two sequences of 5 and 3 positions decoding at query rows 2 and 0 of 3; sequence 0's last position is at
    `last_slot`."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(SLOTS, HKV, D, generator=gen), torch.randn(SLOTS, HKV, D, generator=gen)
    slot_index = torch.tensor([[5, 6, 7, 8, last_slot], [9, 10, 11, 0, 0]])
    row_spans = torch.tensor([[2, 0], [0, 0], [5, 3]])  # rows, starts, ends
    q = torch.randn(3, HQ, D, generator=gen)
    return q, torch.full_like(q, 7.0), k_cache, v_cache, slot_index, row_spans


@pytest.mark.parametrize("slot", [SLOTS, -1], ids=["one-past-the-cache", "negative"])
def test_decode_attention_refuses_a_slot_outside_the_cache_and_writes_nothing(slot):
    q, out, k_cache, v_cache, slot_index, row_spans = _decode_inputs(slot)
    with pytest.raises(ValueError, match="decode_attention: a slot past the cache of 48 slots, or negative"):
        ops.decode_attention(q, out, k_cache, v_cache, slot_index, row_spans, 0.25)
    assert torch.equal(out, torch.full_like(out, 7.0))


@pytest.mark.parametrize("row,start,end,problem", [
    (3, 0, 5, "a row outside the query's 3 rows"), (-1, 0, 5, "a row outside the query's 3 rows"),
    (2, 0, 6, "positions outside the slot index's width 5"), (2, -1, 5, "positions outside the slot index's width 5"),
])
def test_decode_attention_refuses_rows_and_positions_outside_the_query_and_the_slot_index(row, start, end, problem):
    q, out, k_cache, v_cache, slot_index, row_spans = _decode_inputs(SLOTS - 1)
    row_spans[:, 0] = torch.tensor([row, start, end])
    with pytest.raises(ValueError, match=problem):
        ops.decode_attention(q, out, k_cache, v_cache, slot_index, row_spans, 0.25)
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_decode_attention_refuses_an_out_of_another_shape_and_mismatched_caches():
    q, out, k_cache, v_cache, slot_index, row_spans = _decode_inputs(SLOTS - 1)
    with pytest.raises(ValueError, match="is not shaped as the query"):
        ops.decode_attention(q, torch.empty(3, HQ, 8), k_cache, v_cache, slot_index, row_spans, 0.25)
    with pytest.raises(ValueError, match="do not match keys"):
        ops.decode_attention(q, out, k_cache, v_cache[:-1], slot_index, row_spans, 0.25)
    with pytest.raises(ValueError, match="row_spans must be \\[3, 2\\]"):
        ops.decode_attention(q, out, k_cache, v_cache, slot_index, row_spans[:, :1], 0.25)


@needs("decode_attention")
def test_decode_attention_reads_the_last_slot_of_the_cache():
    require("decode_attention")
    q, out, k_cache, v_cache, slot_index, row_spans = _decode_inputs(SLOTS - 1)
    ops.decode_attention(q, out, k_cache, v_cache, slot_index, row_spans, 0.25)
    keys = k_cache[slot_index[0]].repeat_interleave(HQ // HKV, dim=1)  # [5, Hq, D]
    values = v_cache[slot_index[0]].repeat_interleave(HQ // HKV, dim=1)
    weights = (torch.einsum("hd,phd->hp", q[2], keys) * 0.25).softmax(-1)
    torch.testing.assert_close(out[2], torch.einsum("hp,phd->hd", weights, values), rtol=0, atol=2e-6)
    assert torch.equal(out[1], torch.full_like(out[1], 7.0))  # not a decode row


# ----- RMSNorm -----

def test_rms_norm_refuses_rows_that_are_not_one_strided_run_and_a_weight_of_another_size():
    transposed = torch.randn(1, 64, 4).transpose(1, 2)  # elements of a row 4 apart
    with pytest.raises(ValueError, match="rows of H contiguous"):
        ops.rms_norm(transposed, torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="rows of H contiguous"):
        ops.rms_norm(torch.randn(2, 64), torch.ones(63), 1e-5)
    assert not ops.can_norm(transposed, torch.ones(64)) and ops.can_norm(torch.randn(4, 128)[:, :64], torch.ones(64))


def test_ops_reach_the_dispatcher_under_a_torch_function_mode():
    """The direct call (ops.DIRECT_CALLS) skips torch's dispatcher only where nothing observes it: a TorchFunctionMode
    (like the profiler, a dispatch mode or a tracer) sees the op."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, weight = torch.randn(1, 2, 16), torch.ones(16)
    with Record():
        try:
            ops.gemma_rms_norm(x, weight, 1e-6, x)
        except RuntimeError:
            pass  # the library may not be built here: the call still went through the op
    assert any("gemma_rms_norm" in name for name in seen)
