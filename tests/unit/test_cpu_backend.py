"""The CPU attention backend (layers/attention/cpu_backend.py): its native decode kernel `tgi_vlm::decode_attention`
against a float64 reference and the reference backend's gather path, on paged caches with scattered blocks (head
sizes, query groups, lengths around the kernel's 16-position blocks, windows, Llama4 chunks, decode rows mixed among
prefill rows, strided queries); and the backend's choice of decode path (kernel, mirror, gather)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.kernels_here import kernels, needs, op_calls, require
from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.attention import CpuPagedBackend, NativeDecodeStep, TorchPagedBackend, make_backend
from tgi_vlm.layers.attention.kv_cache import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup, decode_mask
from tgi_vlm.layers.attention.torch_backend import gather_decode

needs_kernel = needs("decode_attention")

BLOCK = 16


@pytest.fixture(scope="module")
def native():
    return require("decode_attention")


def _attend(q, out, k_flat, v_flat, step: NativeDecodeStep, scale, window, chunk):
    ops.decode_attention(q, out, k_flat, v_flat, step.slot_index, step.row_spans(window, chunk),
                         scale if scale is not None else q.shape[-1] ** -0.5)


def _paged(lens, hkv, head_dim, dtype, seed):
    """A paged cache holding random K/V for sequences of `lens`, in shuffled blocks; the decode group's slot
    index (padding points at slot 0, which holds garbage that must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-n // BLOCK) for n in lens)
    cache = PagedKVCache(KVCacheSpec(1, hkv, head_dim, BLOCK, dtype), blocks_needed + 8, "cpu")
    for tensor in (cache.keys[0], cache.values[0]):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(dtype))
        tensor[0] = 1e4  # block 0 (padding's slot): any read of it shows in the result
    order = (torch.randperm(blocks_needed + 7, generator=gen) + 1).tolist()
    width = max(lens)
    slot_index = torch.zeros(len(lens), width, dtype=torch.long)
    for row, n in enumerate(lens):
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        slots = torch.tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])[:n]
        slot_index[row, :n] = slots
    return cache, slot_index


def _exact(q, k_flat, v_flat, slot_index, lens, rows, scale, window, chunk):
    """float64 softmax(q·k·scale)·v over each row's visible positions (decode_mask's rule)."""
    hq, hkv = q.shape[1], k_flat.shape[1]
    mask = decode_mask(torch.tensor(lens), slot_index.shape[1], window, chunk)[:, 0, 0]
    out = {}
    for b, row in enumerate(rows):
        keys = k_flat[slot_index[b]].double().repeat_interleave(hq // hkv, dim=1)  # [W, Hq, D]
        values = v_flat[slot_index[b]].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,whd->hw", q[row].double(), keys) * scale
        scores = scores.masked_fill(~mask[b], -math.inf)
        out[row] = torch.einsum("hw,whd->hd", scores.softmax(-1), values)
    return out


def _ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    mantissa = {torch.bfloat16: 7, torch.float32: 23}[dtype]
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - mantissa)


CASES = [
    # (dtype, head_dim, hq, hkv, lens, window, chunk)
    (torch.bfloat16, 64, 12, 4, [1, 15, 16, 17, 33, 300, 431], None, None),
    (torch.float32, 64, 12, 4, [1, 15, 16, 17, 33, 300, 431], None, None),
    (torch.bfloat16, 128, 14, 2, [5, 64, 129], None, None),
    (torch.float32, 128, 14, 2, [5, 64, 129], None, None),
    (torch.bfloat16, 256, 8, 4, [40, 7], None, None),
    (torch.float32, 256, 8, 4, [40, 7], None, None),
    (torch.bfloat16, 64, 5, 1, [9, 70], None, None),  # G = 5: query groups of 4 and 1
    (torch.float32, 64, 5, 1, [9, 70], None, None),
    (torch.bfloat16, 64, 6, 1, [9, 70], None, None),  # G = 6: 4 and 2
    (torch.float32, 64, 6, 1, [9, 70], None, None),
    (torch.bfloat16, 64, 12, 4, [150], None, None),  # one sequence: items are (sequence, kv head) pairs
    (torch.float32, 64, 12, 4, [150], None, None),
    (torch.bfloat16, 16, 4, 2, [3, 18, 90], None, None),  # the tiny test models' head size
    (torch.float32, 16, 4, 1, [3, 18, 90], None, None),
    (torch.bfloat16, 48, 6, 6, [20, 50], None, None),  # 32 + a 16-wide chunk
    (torch.float32, 80, 3, 3, [20, 50], None, None),
    (torch.bfloat16, 64, 8, 2, [10, 100, 257], 24, None),  # sliding window
    (torch.float32, 64, 8, 2, [10, 100, 257], 24, None),
    (torch.bfloat16, 32, 4, 2, [31, 32, 33, 70], None, 32),  # Llama4 attention chunks
    (torch.float32, 32, 4, 2, [31, 32, 33, 70], None, 32),
]


@needs_kernel
@pytest.mark.parametrize("dtype,head_dim,hq,hkv,lens,window,chunk", CASES)
def test_kernel_matches_float64_reference(native, dtype, head_dim, hq, hkv, lens, window, chunk):
    cache, slot_index = _paged(lens, hkv, head_dim, dtype, seed=head_dim + hq + len(lens))
    k_flat, v_flat = cache.flat(0)
    # Decode rows scattered among other rows (a step with prefill chunks), query a strided view as in the
    # model ([1, Hq, T, D] transposed), its last dim contiguous.
    total = 2 * len(lens) + 3
    rows = [2 * b + 1 for b in range(len(lens))]
    q = torch.randn(1, hq, total, head_dim).to(dtype)[0].transpose(0, 1)  # [T, Hq, D], non-contiguous
    out = torch.full_like(q, 7.0)
    step = NativeDecodeStep(DecodeGroup.build(rows, lens, slot_index, total))
    assert ops.can_decode(q, k_flat, v_flat, None)
    _attend(q, out, k_flat, v_flat, step, None, window, chunk)

    exact = _exact(q, k_flat, v_flat, slot_index, lens, rows, head_dim ** -0.5, window, chunk)
    for row in range(total):
        if row not in exact:
            assert torch.equal(out[row], torch.full_like(out[row], 7.0)), f"row {row} is not a decode row but changed"
            continue
        error = (out[row].double() - exact[row]).abs()
        # float32: sums in another order; bfloat16: computed in float32 and rounded once, to nearest (half an
        # ulp, plus float32's own error; truncating would show as errors up to a whole ulp).
        bound = 2e-6 if dtype == torch.float32 else 0.5 * _ulp(exact[row], dtype) + 1e-5 * exact[row].abs() + 1e-7
        assert (error <= bound).all(), f"{dtype} D={head_dim} row {row}: max error {error.max():.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_the_torch_path(native, dtype):
    lens = [80, 130, 200, 431, 17, 301, 256, 99, 300, 120, 64, 65, 410]
    cache, slot_index = _paged(lens, 4, 64, dtype, seed=3)
    k_flat, v_flat = cache.flat(0)
    q = torch.randn(len(lens), 12, 64).to(dtype)
    group = DecodeGroup.build(list(range(len(lens))), lens, slot_index, len(lens))
    meta = AttentionMetadata(kv_cache=cache, slots=torch.zeros(0, dtype=torch.long), decode=group, prefills=[])
    reference = torch.empty_like(q)
    gather_decode(q, reference, k_flat, v_flat, meta, 0.11, None, None, None)
    got = torch.empty_like(q)
    _attend(q, got, k_flat, v_flat, NativeDecodeStep(group), 0.11, None, None)
    if dtype == torch.float32:  # both at float32 rounding, summed in different orders
        torch.testing.assert_close(got, reference, rtol=0, atol=2e-6)
        return
    # bf16: the kernel is at least as close to the float64 result as the torch path (SDPA rounds its softmax
    # weights to bf16 before the V sum; the kernel keeps them in float32 and rounds once).
    exact = _exact(q, k_flat, v_flat, slot_index, lens, list(range(len(lens))), 0.11, None, None)
    exact = torch.stack([exact[row] for row in range(len(lens))])
    assert (got.double() - exact).abs().max() <= (reference.double() - exact).abs().max()


def _backend_step(backend, cache, lens, dtype):
    group = DecodeGroup.build(list(range(len(lens))), lens, torch.zeros(len(lens), max(lens), dtype=torch.long),
                              len(lens), keys=list(range(len(lens))))
    meta = AttentionMetadata(kv_cache=cache, slots=torch.zeros(len(lens), dtype=torch.long), decode=group,
                             prefills=[], backend=backend)
    backend.plan(meta)
    return meta


@needs_kernel
def test_backend_plans_native_decode_and_drops_the_mirror(native):
    cache = PagedKVCache(KVCacheSpec(1, 2, 16, BLOCK, torch.float32), 8, "cpu")
    backend = CpuPagedBackend(decode_mirror=0.5, decode_kernel=True)
    meta = _backend_step(backend, cache, [3, 5], torch.float32)
    assert isinstance(meta.backend_state, NativeDecodeStep)
    assert backend.mirror is None
    # without the kernel the same step plans the mirror
    fallback = CpuPagedBackend(decode_mirror=0.5, decode_kernel=False)
    assert not isinstance(_backend_step(fallback, cache, [3, 5], torch.float32).backend_state, NativeDecodeStep)
    # an fp16 cache is not the kernel's: the mirror
    half = PagedKVCache(KVCacheSpec(1, 2, 16, BLOCK, torch.float16), 8, "cpu")
    assert not isinstance(_backend_step(backend, half, [3, 5], torch.float16).backend_state, NativeDecodeStep)


@needs_kernel
def test_soft_capped_layer_falls_back_and_later_steps_use_the_mirror(native):
    lens = [6, 9]
    cache, slot_index = _paged(lens, 2, 16, torch.float32, seed=5)
    backend = CpuPagedBackend(decode_mirror=0.5, decode_kernel=True)
    group = DecodeGroup.build([0, 1], lens, slot_index, 2, keys=[11, 12])
    meta = AttentionMetadata(kv_cache=cache, slots=slot_index[torch.arange(2), torch.tensor(lens) - 1],
                             decode=group, prefills=[], backend=backend)
    backend.plan(meta)
    assert isinstance(meta.backend_state, NativeDecodeStep)
    q = torch.randn(1, 4, 2, 16)
    k = cache.flat(0)[0][meta.slots].transpose(0, 1)[None].clone()
    v = cache.flat(0)[1][meta.slots].transpose(0, 1)[None].clone()
    with op_calls() as calls:
        capped = backend.forward(0, q, k, v, meta, scaling=None, sliding_window=None, softcap=3.0)
    reference = TorchPagedBackend()
    meta.backend_state = None
    expected = reference.forward(0, q, k, v, meta, scaling=None, sliding_window=None, softcap=3.0)
    assert torch.equal(capped, expected) and not calls
    assert backend.native_unsuitable
    backend.plan(meta)
    assert not isinstance(meta.backend_state, NativeDecodeStep)


def test_a_decode_group_longer_than_its_slot_index_is_refused_when_planned():
    _, slot_index = _paged([5, 9], 2, 16, torch.float32, seed=7)
    with pytest.raises(ValueError, match="exceeds"):
        NativeDecodeStep(DecodeGroup.build([0, 1], [5, 99], slot_index, 2))


def test_row_spans_are_each_rows_query_row_and_visible_positions():
    """What the kernel is told to attend: end = kv_len; start from the sliding window and the attention chunk,
    the positions `decode_mask` lets through."""
    step = NativeDecodeStep(DecodeGroup.build([4, 0, 2], [10, 33, 64], torch.zeros(3, 64, dtype=torch.long), 5))
    assert step.row_spans(None, None).tolist() == [[4, 0, 2], [0, 0, 0], [10, 33, 64]]
    assert step.row_spans(8, None).tolist() == [[4, 0, 2], [2, 25, 56], [10, 33, 64]]
    assert step.row_spans(None, 32).tolist() == [[4, 0, 2], [0, 32, 32], [10, 33, 64]]
    for window, chunk in ((None, None), (8, None), (None, 32), (8, 32)):
        rows, starts, ends = step.row_spans(window, chunk).tolist()
        mask = decode_mask(torch.tensor([10, 33, 64]), 64, window, chunk)[:, 0, 0]
        assert [m.nonzero().flatten().tolist() for m in mask] == [list(range(s, e)) for s, e in zip(starts, ends)]


def test_make_backend_gives_the_cpu_backend_on_cpu_and_the_reference_elsewhere():
    cpu_backend = make_backend("torch", device="cpu", decode_mirror=0.5, kernels=KernelSettings())
    assert type(cpu_backend) is CpuPagedBackend and cpu_backend.name == "torch" and cpu_backend.mirror_share == 0.5
    assert type(make_backend("torch", device="cuda:0", decode_mirror=0.5)) is TorchPagedBackend
    assert type(make_backend("torch")) is TorchPagedBackend


def test_the_setting_turns_the_decode_kernel_off_and_on_where_it_loads():
    off = make_backend("torch", device="cpu", kernels=KernelSettings(native_attention=False))
    on = make_backend("torch", device="cpu", kernels=KernelSettings(native_attention=True))
    assert off.decode_kernel is False
    assert on.decode_kernel is kernels().available("decode_attention")
