"""The flashinfer backend's planning, driven on CPU through a fake `flashinfer` (tests/fakes) whose
wrappers attend from exactly what was planned: every step shape must give the torch reference's
output (float32, so to rounding), sliding windows must be planned as `window_left = window - 1`,
bidirectional image blocks as one custom mask, CUDA-graph replays must re-plan every key on the
same fixed buffers, and planning must take its lengths from the host lists, never the device."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.fakes import flashinfer as fake_flashinfer
from tgi_vlm.layers.attention import (
    AttentionMetadata,
    AttentionPattern,
    DecodeGroup,
    FlashinferBackend,
    KVCacheSpec,
    PagedKVCache,
    PrefillSpan,
    TorchPagedBackend,
    flashinfer_available,
    resolve_backend,
)
from tgi_vlm.models.cuda_graphs import StaticDecodeInputs, plan_replay

BS, HQ, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 32
SCALE = 0.3  # not D ** -0.5: a backend that drops the scale shows


@dataclass
class Seq:
    """One sequence of a step: `kv_len` positions after it, `q_len` of them fed now (1 = decode)."""

    kv_len: int
    q_len: int
    blocks: list[int]
    groups: list[int] | None = None  # bidirectional group per position, -1 causal


# decode A (2 pages) | prefill chunk B (2 cached + 5 new) | decode C (1 position) | prefill D (3 new)
MIXED = [Seq(6, 1, [3, 5]), Seq(7, 5, [7, 9]), Seq(1, 1, [2]), Seq(3, 3, [11])]
DECODE = [Seq(9, 1, [3, 5, 6]), Seq(1, 1, [2]), Seq(4, 1, [7])]
# Gemma3-like: an 8-token prompt with two image blocks, between two decoding sequences
IMAGE = [Seq(6, 1, [3, 5]), Seq(8, 8, [7, 9], groups=[-1, -1, 0, 0, 0, -1, 1, 1]), Seq(1, 1, [2])]


@pytest.fixture
def fake(monkeypatch):
    return fake_flashinfer.install(monkeypatch)


def _cache(dtype: torch.dtype = torch.float32, device: str = "cpu") -> PagedKVCache:
    """Two layers, random everywhere: the history of every sequence, and garbage behind any wrong page."""
    cache = PagedKVCache(KVCacheSpec(2, HKV, D, BS, dtype), NUM_BLOCKS, device)
    if device != "meta":
        gen = torch.Generator().manual_seed(0)
        for t in cache.keys + cache.values:
            t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def _slots(blocks: list[int], n: int) -> torch.Tensor:
    return torch.tensor([b * BS + j for b in blocks for j in range(BS)][:n])


def _step(cache: PagedKVCache, seqs: list[Seq], device: str = "cpu") -> AttentionMetadata:
    """The metadata build_step makes for `seqs` in row order (models/step.py)."""
    row, slots, singles, spans = 0, [], [], []
    for s in seqs:
        slot_index = _slots(s.blocks, s.kv_len).to(device)
        slots.append(slot_index[s.kv_len - s.q_len :])
        if s.q_len == 1:
            singles.append((row, s.kv_len, slot_index))
        else:
            groups = None if s.groups is None else torch.tensor(s.groups, device=device)
            spans.append(PrefillSpan(row, row + s.q_len, s.kv_len, slot_index, groups))
        row += s.q_len
    decode = None
    if singles:
        padded = torch.nn.utils.rnn.pad_sequence([t for _, _, t in singles], batch_first=True)
        decode = DecodeGroup.build([r for r, _, _ in singles], [n for _, n, _ in singles], padded, row)
    return AttentionMetadata(kv_cache=cache, slots=torch.cat(slots), decode=decode, prefills=spans)


def _qkv(tokens: int, seed: int = 1, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, tokens, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    return q.to(device), k.to(device), v.to(device)


def _forward(backend, layer: int, qkv, meta: AttentionMetadata, window: int | None = None, softcap=None):
    return backend.forward(layer, *qkv, meta, scaling=SCALE, sliding_window=window, softcap=softcap)


def _compare(seqs: list[Seq], *, layer: int = 0, window: int | None = None, softcap: float | None = None,
             pattern: AttentionPattern | None = None, dtype: torch.dtype = torch.float32):
    """(flashinfer, torch reference) outputs `[1, T, Hq, D]` of one layer of the step `seqs`."""
    cache = _cache(dtype)
    qkv = _qkv(sum(s.q_len for s in seqs), dtype=dtype)
    ref = _forward(TorchPagedBackend(pattern), layer, qkv, _step(cache, seqs), window, softcap)
    backend = FlashinferBackend(pattern)
    meta = _step(cache, seqs)
    backend.plan(meta)
    return _forward(backend, layer, qkv, meta, window, softcap), ref


def _planned(fake) -> list[fake_flashinfer.Planned]:
    return [w.planned for w in fake.created]


# ----- step shapes -----
def test_a_mixed_step_is_one_causal_prefill_plan_over_every_sequence_in_row_order(fake):
    out, ref = _compare(MIXED)
    torch.testing.assert_close(out, ref)
    (wrapper,) = fake.created
    assert isinstance(wrapper, fake.BatchPrefillWithPagedKVCacheWrapper)
    plan = wrapper.planned
    assert plan.qo_indptr.tolist() == [0, 1, 6, 7, 10]
    assert (plan.causal, plan.custom_mask, plan.window_left, plan.sm_scale) == (True, None, -1, SCALE)


def test_a_decode_only_step_plans_the_tensor_core_decode_wrapper(fake):
    out, ref = _compare(DECODE)
    torch.testing.assert_close(out, ref)
    (wrapper,) = fake.created
    assert isinstance(wrapper, fake.BatchDecodeWithPagedKVCacheWrapper)
    assert wrapper.use_tensor_cores and not wrapper.use_cuda_graph
    assert wrapper.planned.kv_indptr.tolist() == [0, 3, 4, 5]


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_a_window_shorter_than_the_sequences_is_planned_as_window_left_window_minus_one(fake, seqs):
    out, ref = _compare(seqs, window=3)
    torch.testing.assert_close(out, ref)
    assert [p.window_left for p in _planned(fake)] == [2]
    unwindowed, _ = _compare(seqs)
    assert not torch.allclose(out, unwindowed)  # the window does mask something here


@pytest.mark.parametrize("window", [None, 3])
def test_bidirectional_image_blocks_are_planned_as_one_custom_mask(fake, window):
    out, ref = _compare(IMAGE, window=window)
    torch.testing.assert_close(out, ref)
    (plan,) = _planned(fake)
    assert plan.custom_mask is not None and not plan.causal and plan.window_left == -1  # the window is in the mask
    assert plan.custom_mask.numel() == 1 * 6 + 8 * 8 + 1 * 1
    causal_only = [Seq(s.kv_len, s.q_len, s.blocks) for s in IMAGE]
    assert not torch.allclose(out, _compare(causal_only, window=window)[1])


def test_softcapped_layers_fall_back_to_the_torch_reference_without_planning(fake):
    out, ref = _compare(MIXED, softcap=2.0)
    torch.testing.assert_close(out, ref)
    assert fake.created == []


def test_chunked_layers_fall_back_and_the_other_layers_still_plan(fake):
    pattern = AttentionPattern({1: 4})  # Llama4: layer 1 attends within chunks of 4 positions
    out, ref = _compare(MIXED, layer=1, pattern=pattern)
    torch.testing.assert_close(out, ref)
    assert fake.created == []
    out, ref = _compare(MIXED, layer=0, pattern=pattern)
    torch.testing.assert_close(out, ref)
    assert len(fake.created) == 1


def test_bf16_layers_plan_bf16_and_agree_with_the_reference_to_bf16_precision(fake):
    out, ref = _compare(MIXED, window=3, dtype=torch.bfloat16)
    (plan,) = _planned(fake)
    assert (plan.q_data_type, plan.kv_data_type) == (torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_float32_layers_use_the_torch_reference_in_production(monkeypatch):
    fake = fake_flashinfer.install(monkeypatch, float32=False)
    out, ref = _compare(MIXED)
    torch.testing.assert_close(out, ref)
    assert fake.created == []


def test_the_backend_is_available_with_flashinfer_importable_and_cuda(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flashinfer_available()
    assert resolve_backend("flashinfer", "cuda:0") == "flashinfer"


# ----- CUDA-graph re-planning -----
LAYERS = [(0, None), (1, 3)]  # a full and a sliding layer: two plan keys
GRAPH_SIZE, GRAPH_KV = 4, 16
REPLAYS = [  # what each replay of the size-4 graph holds: other lengths, pages and batch sizes
    [Seq(5, 1, [3, 5]), Seq(9, 1, [6, 7, 8]), Seq(2, 1, [10])],
    [Seq(16, 1, [12, 13, 14, 15]), Seq(1, 1, [2]), Seq(7, 1, [16, 17]), Seq(12, 1, [18, 19, 20])],
    [Seq(3, 1, [21])],
]


def _captured(cache: PagedKVCache) -> tuple[FlashinferBackend, StaticDecodeInputs]:
    """A backend that learnt its keys from one eager step (as warmup does), then a captured size 4."""
    backend = FlashinferBackend()
    meta = _step(cache, DECODE)
    backend.plan(meta)
    for layer, window in LAYERS:
        _forward(backend, layer, _qkv(len(DECODE)), meta, window)
    return backend, _capture(backend, cache, GRAPH_KV)


def _capture(backend: FlashinferBackend, cache: PagedKVCache, max_kv_len: int) -> StaticDecodeInputs:
    static = StaticDecodeInputs.allocate(GRAPH_SIZE, hidden=1, position_rows=1, max_kv_len=max_kv_len,
                                         kv_cache=cache, dtype=torch.float32, device=torch.device("cpu"),
                                         backend=backend)
    backend.prepare_for_capture(static.metadata, GRAPH_SIZE)
    return static


def _fill(static: StaticDecodeInputs, meta: AttentionMetadata) -> int:
    batch = len(meta.decode.kv_len_list)
    plan = plan_replay(meta, (GRAPH_SIZE,), static.slot_index.shape[1])
    static.fill(plan, torch.zeros(batch, 1), torch.zeros(1, batch, dtype=torch.long), meta)
    return batch


def _replay_matches_reference(backend, static, cache, seqs, layer, window, seed) -> bool:
    batch = len(seqs)
    q, k, v = _qkv(GRAPH_SIZE, seed=seed)  # padding rows get values too; their outputs are dropped
    out = _forward(backend, layer, (q, k, v), static.metadata, window)[:, :batch]
    ref = _forward(TorchPagedBackend(), layer, (q[:, :, :batch], k[:, :, :batch], v[:, :, :batch]),
                   _step(cache, seqs), window)
    return torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_every_graph_replay_re_plans_every_key_on_the_same_fixed_buffers(fake):
    cache = _cache()
    backend, static = _captured(cache)
    graph_wrappers = [w for w in fake.created if w.use_cuda_graph]
    assert len(graph_wrappers) == len(LAYERS)  # one fixed-buffer wrapper per key for this size
    buffers = [tuple(b.data_ptr() for b in w.buffers) for w in graph_wrappers]
    for seed, seqs in enumerate(REPLAYS):
        _fill(static, _step(cache, seqs))
        backend.prepare_for_replay(static.metadata, GRAPH_SIZE)
        for layer, window in LAYERS:
            assert _replay_matches_reference(backend, static, cache, seqs, layer, window, seed), (seed, layer)
    assert [w for w in fake.created if w.use_cuda_graph] == graph_wrappers  # no wrapper made after capture
    assert [tuple(b.data_ptr() for b in w.buffers) for w in graph_wrappers] == buffers
    assert [w.plan_calls for w in graph_wrappers] == [1 + len(REPLAYS)] * len(LAYERS)
    assert sorted(w.planned.window_left for w in graph_wrappers) == [-1, 2]


def test_a_replay_without_re_planning_would_attend_over_the_previous_tables(fake):
    """What the test above guards against: the fixed buffers keep the last plan's page tables."""
    cache = _cache()
    backend, static = _captured(cache)
    _fill(static, _step(cache, REPLAYS[0]))
    backend.prepare_for_replay(static.metadata, GRAPH_SIZE)
    _fill(static, _step(cache, REPLAYS[1]))  # refilled, not re-planned
    assert not _replay_matches_reference(backend, static, cache, REPLAYS[1], 0, None, seed=0)


def test_a_recapture_for_longer_sequences_plans_into_buffers_with_room_for_them(fake):
    """A second Warmup with a larger max_total_tokens re-captures every size with wider static inputs."""
    cache = _cache()
    backend, _ = _captured(cache)  # static width 16: room for 4 rows of 4 pages
    static = _capture(backend, cache, max_kv_len=64)
    seqs = [Seq(60, 1, list(range(3, 18))), Seq(20, 1, list(range(18, 23)))]  # 15 + 5 pages
    _fill(static, _step(cache, seqs))
    backend.prepare_for_replay(static.metadata, GRAPH_SIZE)
    for layer, window in LAYERS:
        assert _replay_matches_reference(backend, static, cache, seqs, layer, window, seed=0), layer


# ----- host lengths only -----
def test_planning_follows_the_host_lists_when_the_device_tensors_disagree(fake):
    cache = _cache()
    qkv = _qkv(10)
    ref = _forward(TorchPagedBackend(), 0, qkv, _step(cache, MIXED))
    shorter = _step(cache, MIXED)
    shorter.decode.kv_lens = torch.tensor([1, 1])  # the host lists say [6, 1]
    # The device lengths do matter to a backend that reads them (torch masks by them). (Not checked
    # with the wrong rows too: torch would then leave rows of an uninitialised output unwritten.)
    assert not torch.allclose(_forward(TorchPagedBackend(), 0, qkv, shorter), ref)
    meta = _step(cache, MIXED)
    meta.decode.kv_lens = torch.tensor([1, 1])  # the host lists say [6, 1]
    meta.decode.rows = torch.tensor([9, 9])  # the host lists say [0, 6]
    backend = FlashinferBackend()
    backend.plan(meta)
    torch.testing.assert_close(_forward(backend, 0, qkv, meta), ref)


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_planning_reads_no_device_value_back(fake, seqs):
    """Every device tensor on the meta device (shapes only, no values to read): planning and the
    forward still run, and flashinfer is handed host page-table indptrs, which it copies without a sync."""
    cache = _cache(device="meta")
    meta = _step(cache, seqs, device="meta")
    backend = FlashinferBackend()
    backend.plan(meta)
    tokens = sum(s.q_len for s in seqs)
    for layer, window in LAYERS:
        out = _forward(backend, layer, _qkv(tokens, device="meta"), meta, window)
        assert out.shape == (1, tokens, HQ, D)
    assert len(fake.created) == len(LAYERS)
    assert [w.read_backs for w in fake.created] == [[], []]


def test_graph_re_planning_reads_no_device_value_back(fake):
    cache = _cache(device="meta")
    backend = FlashinferBackend()
    meta = _step(cache, DECODE, device="meta")
    backend.plan(meta)
    for layer, window in LAYERS:
        _forward(backend, layer, _qkv(len(DECODE), device="meta"), meta, window)
    static = StaticDecodeInputs.allocate(GRAPH_SIZE, hidden=1, position_rows=1, max_kv_len=GRAPH_KV, kv_cache=cache,
                                         dtype=torch.float32, device=torch.device("meta"), backend=backend)
    backend.prepare_for_capture(static.metadata, GRAPH_SIZE)
    for seqs in REPLAYS:
        step = _step(cache, seqs, device="meta")
        plan = plan_replay(step, (GRAPH_SIZE,), GRAPH_KV)
        embeds = torch.zeros(len(seqs), 1, device="meta")
        static.fill(plan, embeds, torch.zeros(1, len(seqs), dtype=torch.long, device="meta"), step)
        backend.prepare_for_replay(static.metadata, GRAPH_SIZE)
    graph_wrappers = [w for w in fake.created if w.use_cuda_graph]
    assert [w.plan_calls for w in graph_wrappers] == [1 + len(REPLAYS)] * len(LAYERS)
    assert all(w.read_backs == [] for w in graph_wrappers)
