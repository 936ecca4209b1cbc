"""CUDA-graph bookkeeping on CPU: which captured size a decode step replays, how the static buffers
are padded, that outputs are sliced back, and that decoding through the eager stand-in of the graph
gives exactly the tokens of plain eager decoding."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tgi_vlm.config import DEFAULT_CUDA_GRAPHS
from tgi_vlm.layers.attention import AttentionMetadata, DecodeGroup, KVCacheSpec, PagedKVCache, PrefillSpan
from tgi_vlm.layers.step_context import StepContext
from tgi_vlm.models.cuda_graphs import (
    CapturedDecode,
    DecodeGraphs,
    GraphPlan,
    StaticDecodeInputs,
    graph_max_kv_len,
    next_captured_size,
    plan_replay,
    setup_decode_graphs,
)
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

SIZES = DEFAULT_CUDA_GRAPHS  # (1, 2, 4, 8, 16, 32)
BLOCK = 4


def _cache(num_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, block_size=BLOCK, dtype=torch.float32),
                        num_blocks, "cpu")


def _decode_meta(kv_lens: list[int], cache: PagedKVCache | None = None) -> AttentionMetadata:
    """A decode-only step: sequence i owns blocks starting at 1 + 4*i and feeds position kv_lens[i]-1."""
    rows = []
    for i, n in enumerate(kv_lens):
        first = (1 + 4 * i) * BLOCK
        rows.append(torch.arange(first, first + n))
    slot_index = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    group = DecodeGroup.build(list(range(len(kv_lens))), kv_lens, slot_index, num_tokens=len(kv_lens))
    slots = torch.stack([r[-1] for r in rows])
    return AttentionMetadata(kv_cache=cache or _cache(), slots=slots, decode=group, prefills=[])


@pytest.mark.parametrize(("batch", "size"), [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (17, 32), (32, 32), (33, None)])
def test_a_batch_replays_the_next_captured_size_and_above_the_largest_runs_eagerly(batch, size):
    assert next_captured_size(batch, SIZES) == size


def test_plan_for_a_decode_step_names_size_batch_pad_and_kv_width():
    plan = plan_replay(_decode_meta([5, 9, 2]), SIZES, max_kv_len=64)
    assert plan == GraphPlan(size=4, batch=3, kv_width=9)
    assert plan.pad == 1


def test_decode_batch_above_the_largest_size_gets_no_plan():
    assert plan_replay(_decode_meta([3] * 33), SIZES, max_kv_len=64) is None


def test_decode_longer_than_the_static_kv_width_gets_no_plan():
    assert plan_replay(_decode_meta([3, 65]), SIZES, max_kv_len=64) is None


def test_steps_with_a_prefill_span_get_no_plan():
    meta = _decode_meta([4, 6])
    meta.prefills = [PrefillSpan(q_start=2, q_end=5, kv_len=3, slot_index=torch.arange(3))]
    meta.decode.rows_are_all = False
    assert plan_replay(meta, SIZES, max_kv_len=64) is None


def test_prefill_only_step_gets_no_plan():
    meta = AttentionMetadata(kv_cache=_cache(), slots=torch.arange(3), decode=None,
                             prefills=[PrefillSpan(q_start=0, q_end=3, kv_len=3, slot_index=torch.arange(3))])
    assert plan_replay(meta, SIZES, max_kv_len=64) is None


def _filled(kv_lens: list[int], rows: int = 1, size: int = 4, hidden: int = 3):
    cache = _cache()
    meta = _decode_meta(kv_lens, cache)
    static = StaticDecodeInputs.allocate(size, hidden, rows, max_kv_len=16, kv_cache=cache,
                                         dtype=torch.float32, device=torch.device("cpu"))
    static.slots.fill_(7)  # stale values from an earlier, larger step must be overwritten
    static.slot_index.fill_(7)
    static.kv_lens.fill_(7)
    b = len(kv_lens)
    embeds = torch.arange(b * hidden, dtype=torch.float32).reshape(b, hidden) + 1
    positions = torch.tensor(kv_lens) - 1 + 100
    positions = positions.expand(3, b).clone()[:, None, :] if rows == 3 else positions[None]
    plan = plan_replay(meta, (size,), max_kv_len=16)
    static.fill(plan, embeds, positions, meta)
    return static, meta, embeds, positions


def test_fill_copies_the_step_and_points_every_padding_slot_at_block_zero():
    static, meta, embeds, _ = _filled([5, 9, 2])
    assert static.slots.tolist() == meta.slots.tolist() + [0]
    assert static.slot_index[3].tolist() == [0] * 16
    assert torch.equal(static.slot_index[:3, :9], meta.decode.slot_index)
    assert static.slot_index[:3, 9:].eq(0).all()
    assert static.kv_lens.tolist() == [5, 9, 2, 1]
    assert torch.equal(static.inputs_embeds[0, :3], embeds)
    assert static.inputs_embeds[0, 3].eq(0).all()


def test_fill_pads_all_three_mrope_rows():
    static, _, _, positions = _filled([5, 9, 2], rows=3)
    assert static.position_ids.shape == (3, 1, 4)
    assert torch.equal(static.position_ids[..., :3], positions)
    assert static.position_ids[..., 3].eq(0).all()


def test_fill_pads_plain_positions():
    static, _, _, _ = _filled([5, 9, 2])
    assert static.position_ids.tolist() == [[104, 108, 101, 0]]


def test_fill_refuses_positions_of_another_layout():
    cache = _cache()
    meta = _decode_meta([3], cache)
    static = StaticDecodeInputs.allocate(1, 2, 3, max_kv_len=8, kv_cache=cache, dtype=torch.float32,
                                         device=torch.device("cpu"))
    with pytest.raises(ValueError, match="position layout"):
        static.fill(plan_replay(meta, (1,), 8), torch.zeros(1, 2), torch.zeros(1, 1, dtype=torch.long), meta)


def test_static_metadata_views_the_static_buffers():
    static, _, _, _ = _filled([5, 9, 2])
    meta = static.metadata
    assert meta.slots is static.slots and meta.decode.slot_index is static.slot_index
    assert meta.decode.kv_lens is static.kv_lens and meta.decode.rows_are_all and meta.prefills == []


def _adapter_context(adapters: list[int]) -> StepContext:
    """A decode step's context: one row per sequence."""
    n = len(adapters)
    return StepContext(request_ids=tuple(range(n)), row_starts=tuple(range(n + 1)), adapters=tuple(adapters),
                       device=torch.device("cpu"))


def test_fill_copies_each_rows_adapter_into_the_static_buffer_and_padding_rows_get_the_base_model():
    cache = _cache()
    static = StaticDecodeInputs.allocate(4, 2, 1, max_kv_len=16, kv_cache=cache, dtype=torch.float32,
                                         device=torch.device("cpu"))
    for adapters in ([2, 0, 5], [1, 1], [0]):
        meta = _decode_meta([3] * len(adapters), cache)
        b = len(adapters)
        static.fill(plan_replay(meta, (4,), 16), torch.zeros(b, 2), torch.zeros(1, b, dtype=torch.long), meta,
                    _adapter_context(adapters))
        assert static.adapters.tolist() == adapters + [0] * (4 - b)  # no stale index from the larger step
    static.fill(plan_replay(meta, (4,), 16), torch.zeros(1, 2), torch.zeros(1, 1, dtype=torch.long), meta, None)
    assert static.adapters.tolist() == [0, 0, 0, 0]  # no context: every row the base model


def test_fill_refuses_a_context_of_another_step():
    static, meta, embeds, positions = _filled([5, 9, 2])
    with pytest.raises(ValueError, match="the step context has 2 rows but the decode step has 3"):
        static.fill(plan_replay(meta, (4,), 16), embeds, positions, meta, _adapter_context([1, 1]))


def test_replay_slices_the_padded_output_back_to_the_batch_and_calls_the_backend_hook():
    cache = _cache()
    static = StaticDecodeInputs.allocate(4, 2, 1, max_kv_len=16, kv_cache=cache, dtype=torch.float32,
                                         device=torch.device("cpu"))
    prepared = []

    class Backend:
        def prepare_for_replay(self, meta, size):
            prepared.append((meta is static.metadata, size, meta.decode.kv_lens.tolist(), meta.decode.kv_len_list))

    graphs = DecodeGraphs({4: CapturedDecode(static, lambda: torch.arange(8.0).reshape(4, 2))}, 16, Backend())
    meta = _decode_meta([2, 3, 4], cache)
    plan = graphs.plan(meta)
    out = graphs.replay(plan, torch.ones(3, 2), torch.zeros(1, 3, dtype=torch.long), meta)
    assert out.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    # the host lengths (what planning reads, with no device read-back) match the device ones
    assert prepared == [(True, 4, [2, 3, 4, 1], [2, 3, 4, 1])]


def test_position_rows_are_three_only_for_the_mrope_adapters():
    from tgi_vlm.models.architectures import adapter_for, supported_model_types

    rows = {t: adapter_for(t).position_rows for t in supported_model_types()}
    assert {t for t, n in rows.items() if n == 3} == {"qwen2_vl", "qwen2_5_vl"}
    assert {n for n in rows.values()} == {1, 3}


def test_static_kv_width_is_max_total_tokens_in_whole_blocks_capped_by_the_cache():
    assert graph_max_kv_len(10, _cache(num_blocks=64)) == 12
    assert graph_max_kv_len(10_000, _cache(num_blocks=64)) == 256


def test_no_graphs_on_cpu_even_when_sizes_are_configured():
    class Model:
        config = type("C", (), {"cuda_graphs": (1, 2)})()
        device = torch.device("cpu")

    assert setup_decode_graphs(Model(), 128) is None


# ----- decode through the stand-in on tiny models -----
IMG = png_bytes(make_test_image(20, 20, seed=1))
PROMPTS = {
    "llama": [("Hello there",), ("a longer prompt with several words in it",), ("x",), ("third one here",),
              ("five",)],
    "qwen2_vl": [("Look at ", IMG, " and describe it"), ("just text",), (IMG, " what is this"),
                 ("more text to decode",), ("five",)],
}


@pytest.fixture(scope="module", params=sorted(PROMPTS))
def engine(request):
    model = load_engine(request.param)
    model.arch = request.param
    model.ensure_kv_cache()
    return model


class CountingGraphs:
    """The stand-in wrapped to count replays per captured size."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs
        self.replays: list[int] = []

    def plan(self, meta):
        return self.graphs.plan(meta)

    def replay(self, plan, *args):
        self.replays.append(plan.size)
        return self.graphs.replay(plan, *args)


def _generate(engine, graphs, n_requests: int, max_new_tokens: int = 6):
    engine.graphs = graphs
    runner = Runner(engine)
    try:
        prompts = PROMPTS[engine.arch][:n_requests]
        runner.prefill([make_request(i, *p, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)])
        runner.run()
    finally:
        engine.graphs = None
    assert engine.kv_blocks_in_use == 0
    return dict(runner.tokens), dict(runner.logits)


def test_decode_through_the_stand_in_gives_the_eager_tokens(engine):
    eager_tokens, eager_logits = _generate(engine, None, 3)
    counting = CountingGraphs(DecodeGraphs.eager(engine, SIZES, max_kv_len=64))
    tokens, logits = _generate(engine, counting, 3)
    assert tokens == eager_tokens
    assert counting.replays == [4] * 5  # 3 sequences padded to 4, for each of the 5 decode steps
    for rid in tokens:
        assert len(logits[rid]) == len(eager_logits[rid]) == 6  # every step's logits, graphed ones too
        for a, b in zip(logits[rid], eager_logits[rid]):
            assert (a - b).abs().max().item() < 1e-4


def test_a_single_sequence_replays_size_one(engine):
    eager_tokens, _ = _generate(engine, None, 1)
    counting = CountingGraphs(DecodeGraphs.eager(engine, SIZES, max_kv_len=64))
    assert _generate(engine, counting, 1)[0] == eager_tokens
    assert counting.replays == [1] * 5


def test_batches_above_the_largest_size_decode_eagerly(engine):
    eager_tokens, _ = _generate(engine, None, 5)
    counting = CountingGraphs(DecodeGraphs.eager(engine, (2, 4), max_kv_len=64))
    assert _generate(engine, counting, 5)[0] == eager_tokens
    assert counting.replays == []
