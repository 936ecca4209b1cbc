"""The native decode attention kernel (layers/attention/native_decode.py) against a float64 reference and the
torch path, on paged caches with scattered blocks: head sizes, query groups, lengths around the kernel's
16-position blocks, windows, Llama4 chunks, decode rows mixed among prefill rows, strided queries; the backend's
choice of path; and the build cache."""

from __future__ import annotations

import math
import platform
import subprocess
import sys

import pytest
import torch

from tgi_vlm.layers.attention import native_decode
from tgi_vlm.layers.attention.kv_cache import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup, decode_mask, slot_bound
from tgi_vlm.layers.attention.native_decode import NativeDecodeStep
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return " avx512f" in cpuinfo.read()
    except OSError:
        return False


# Only hardware the kernel is not built for skips; where it should load, failing to load fails the tests.
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not _avx512() or native_decode._compiler() is None,
    reason="the native decode kernel needs x86-64 with AVX-512 and a C compiler",
)

BLOCK = 16


@pytest.fixture(scope="module")
def native():
    loaded = native_decode.load()
    assert loaded is not None, "native decode attention did not load on an AVX-512 machine with a compiler"
    return loaded


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
    assert native.can_run(q, k_flat, None)
    native.attend(q, out, k_flat, v_flat, step, None, window, chunk)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_agrees_with_the_torch_path(native, dtype):
    lens = [80, 130, 200, 431, 17, 301, 256, 99, 300, 120, 64, 65, 410]
    cache, slot_index = _paged(lens, 4, 64, dtype, seed=3)
    k_flat, v_flat = cache.flat(0)
    q = torch.randn(len(lens), 12, 64).to(dtype)
    group = DecodeGroup.build(list(range(len(lens))), lens, slot_index, len(lens))
    meta = AttentionMetadata(kv_cache=cache, slots=torch.zeros(0, dtype=torch.long), decode=group, prefills=[])
    from tgi_vlm.layers.attention.torch_backend import _decode

    reference = torch.empty_like(q)
    _decode(q, reference, k_flat, v_flat, meta, 0.11, None, None, None)
    got = torch.empty_like(q)
    native.attend(q, got, k_flat, v_flat, NativeDecodeStep(group), 0.11, None, None)
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


def test_backend_plans_native_decode_and_drops_the_mirror(native):
    cache = PagedKVCache(KVCacheSpec(1, 2, 16, BLOCK, torch.float32), 8, "cpu")
    backend = TorchPagedBackend(decode_mirror=0.5, native=native)
    meta = _backend_step(backend, cache, [3, 5], torch.float32)
    assert isinstance(meta.backend_state, NativeDecodeStep)
    assert backend.mirror is None
    # without the kernel the same step plans the mirror
    fallback = TorchPagedBackend(decode_mirror=0.5, native=None)
    assert not isinstance(_backend_step(fallback, cache, [3, 5], torch.float32).backend_state, NativeDecodeStep)
    # an fp16 cache is not the kernel's: the mirror
    half = PagedKVCache(KVCacheSpec(1, 2, 16, BLOCK, torch.float16), 8, "cpu")
    assert not isinstance(_backend_step(backend, half, [3, 5], torch.float16).backend_state, NativeDecodeStep)


def test_soft_capped_layer_falls_back_and_later_steps_use_the_mirror(native):
    lens = [6, 9]
    cache, slot_index = _paged(lens, 2, 16, torch.float32, seed=5)
    backend = TorchPagedBackend(decode_mirror=0.5, native=native)
    group = DecodeGroup.build([0, 1], lens, slot_index, 2, keys=[11, 12])
    meta = AttentionMetadata(kv_cache=cache, slots=slot_index[torch.arange(2), torch.tensor(lens) - 1],
                             decode=group, prefills=[], backend=backend)
    backend.plan(meta)
    assert isinstance(meta.backend_state, NativeDecodeStep)
    q = torch.randn(1, 4, 2, 16)
    k = cache.flat(0)[0][meta.slots].transpose(0, 1)[None].clone()
    v = cache.flat(0)[1][meta.slots].transpose(0, 1)[None].clone()
    capped = backend.forward(0, q, k, v, meta, scaling=None, sliding_window=None, softcap=3.0)
    reference = TorchPagedBackend(decode_mirror=0.0)
    meta.backend_state = None
    expected = reference.forward(0, q, k, v, meta, scaling=None, sliding_window=None, softcap=3.0)
    assert torch.equal(capped, expected)
    assert backend.native_unsuitable
    backend.plan(meta)
    assert not isinstance(meta.backend_state, NativeDecodeStep)


def test_build_is_cached_by_key(native, tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_VLM_KERNEL_CACHE", str(tmp_path))
    built = native_decode._build()
    assert built.parent == tmp_path and built.exists()
    stamp = built.stat().st_mtime_ns
    assert native_decode._build() == built and built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no scratch left behind


def test_a_failing_compiler_is_an_error_not_a_library(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_VLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="exited 1"):
        native_decode._build()
    assert list(tmp_path.iterdir()) == []


def test_engine_config_turns_it_on_for_cpu_only():
    from tgi_vlm.config import EngineConfig

    assert EngineConfig.from_env({}, device="cpu").native_attention_on
    assert not EngineConfig.from_env({}, device="cuda").native_attention_on
    assert not EngineConfig.from_env({"TGI_VLM_NATIVE_ATTENTION": "1"}, device="cuda").native_attention_on
    assert not EngineConfig.from_env({"TGI_VLM_NATIVE_ATTENTION": "0"}, device="cpu").native_attention_on


def test_loading_the_kernel_keeps_subnormal_floats():
    """Linked with -ffast-math, GCC < 13 would add crtfastmath.o, whose constructor turns on flush-to-zero for the
    whole process when the library loads: every torch computation would change. A fresh process checks it."""
    code = ("import torch; from tgi_vlm.layers.attention import native_decode; assert native_decode.load(); "
            "x = torch.tensor([1e-40]); assert (x * 1.0).item() > 0, 'subnormals flushed'; print('kept')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "kept" in result.stdout, result.stderr[-2000:]


def test_inconsistent_inputs_are_refused_before_the_c_code(native):
    lens = [5, 9]
    cache, slot_index = _paged(lens, 2, 16, torch.float32, seed=7)
    k_flat, v_flat = cache.flat(0)
    q = torch.randn(2, 4, 16)
    step = NativeDecodeStep(DecodeGroup.build([0, 1], lens, slot_index, 2))
    with pytest.raises(ValueError, match="inconsistent"):
        native.attend(q, torch.empty(2, 4, 8), k_flat, v_flat, step, None, None, None)  # out of another shape
    bad = NativeDecodeStep(DecodeGroup.build([0, 1], lens, slot_index + k_flat.shape[0], 2))  # slots past the cache
    with pytest.raises(ValueError, match="inconsistent"):
        native.attend(q, torch.empty_like(q), k_flat, v_flat, bad, None, None, None)
    with pytest.raises(ValueError, match="exceeds"):
        NativeDecodeStep(DecodeGroup.build([0, 1], [5, 99], slot_index, 2))
    qkv, cos = torch.zeros(1, 2, (4 + 2 * 2) * 16), torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="past the cache"):
        native.rotary_and_store(qkv, cos, cos, 4, k_flat, v_flat, torch.tensor([0, 1]), k_flat.shape[0])
    negative = NativeDecodeStep(DecodeGroup.build([0, 1], lens, slot_index - 10_000, 2))  # slots before the cache
    with pytest.raises(ValueError, match="inconsistent"):
        native.attend(q, torch.empty_like(q), k_flat, v_flat, negative, None, None, None)
    with pytest.raises(ValueError, match="past the cache"):
        native.rotary_and_store(qkv, cos, cos, 4, k_flat, v_flat, torch.tensor([0, -3]),
                                slot_bound(torch.tensor([0, -3]), empty=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hkv,head_dim", [(13, 12, 4, 64), (300, 12, 2, 128), (5, 4, 2, 16), (1, 3, 1, 8)])
def test_rotary_and_store_is_bit_equal_to_the_torch_operations(native, dtype, tokens, hq, hkv, head_dim):
    """The lean layer's fused rotary + K/V store against its torch form (`_rotate`, then `write_kv`): the same
    bits in the query, the key, the value and every cache slot (written or not)."""
    from tgi_vlm.layers.attention.torch_backend import write_kv
    from tgi_vlm.layers.cpu_decoder import _rotate

    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = (torch.randn(1, tokens, (hq + 2 * hkv) * head_dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(1, tokens, head_dim, generator=gen) * 20
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    caches = [PagedKVCache(KVCacheSpec(1, hkv, head_dim, BLOCK, dtype), tokens // BLOCK + 4, "cpu") for _ in range(2)]
    slots = torch.randperm(caches[0].num_slots - BLOCK, generator=gen)[:tokens] + BLOCK

    qk = _rotate(qkv[..., : (hq + hkv) * head_dim].view(1, tokens, hq + hkv, head_dim), cos.unsqueeze(2),
                 sin.unsqueeze(2))
    query, key = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
    value = qkv[..., (hq + hkv) * head_dim :].view(1, tokens, hkv, head_dim).transpose(1, 2)
    write_kv(*caches[0].flat(0), key, value, slots)

    assert native.can_rotate(qkv, cos, sin, caches[1].flat(0)[0])
    got = native.rotary_and_store(qkv, cos, sin, hq, *caches[1].flat(0), slots, int(slots.max()))
    for mine, theirs in zip(got, (query, key, value)):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    assert torch.equal(caches[1].keys[0], caches[0].keys[0]) and torch.equal(caches[1].values[0], caches[0].values[0])


def test_the_lean_layer_uses_the_fused_rotary(monkeypatch):
    from tests.conftest import load_engine
    from tgi_vlm.testing.harness import Runner, make_request

    engine = load_engine("qwen2", dtype="bfloat16")
    native = engine.attention.native
    calls = []
    store = native.rotary_and_store
    monkeypatch.setattr(native, "rotary_and_store", lambda *a, **k: (calls.append(1), store(*a, **k))[1])
    runner = Runner(engine)
    runner.prefill([make_request(0, "the cat sat on the mat", max_new_tokens=3)])
    runner.run()
    layers = engine.language_model.config.num_hidden_layers
    assert len(calls) == 3 * layers  # the prefill and two decode steps, every layer
