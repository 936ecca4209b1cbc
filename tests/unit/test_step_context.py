"""The per-row step context (layers/step_context.py): what `build_step` puts in it, how rows map to
sequences and adapters, the rows grouped by adapter, the graphed context, and `current()` / `using()`."""

from __future__ import annotations

import pytest
import torch

from tests.unit.step_sequences import decoding, make_seq
from tgi_vlm.layers.attention import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.step_context import StepContext, current, using
from tgi_vlm.models.adapter_table import AdapterTable, UnknownAdapter
from tgi_vlm.models.step import build_step

CPU = torch.device("cpu")


def _cache() -> PagedKVCache:
    return PagedKVCache(KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32), 64, CPU)


def _context(sizes: list[int], adapters: list[int]) -> StepContext:
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return StepContext(request_ids=tuple(range(1, len(sizes) + 1)), row_starts=tuple(starts),
                       adapters=tuple(adapters), device=CPU)


# ----- what build_step puts in it -----

def test_build_step_gives_one_context_entry_per_scheduled_sequence_in_row_order():
    seqs = [decoding(request_id=7, adapter_id="a", adapter_index=1),
            make_seq(5, request_id=8),  # feeds 0 this step: not in the step, not in the context
            make_seq(6, computed=2, request_id=9, adapter_id="b", adapter_index=2),
            decoding(request_id=3)]
    step = build_step(seqs, [1, 0, 3, 1], _cache(), None, CPU)
    ctx = step.context
    assert ctx.request_ids == (7, 9, 3)
    assert ctx.row_starts == (0, 1, 4, 5)
    assert ctx.adapters == (1, 2, 0)
    assert ctx.num_rows == step.input_ids.numel() == 5
    assert [w.row for w in step.windows] == list(ctx.row_starts[:-1])


# ----- rows, sequences, adapters -----

def test_every_row_knows_its_sequence_and_adapter():
    ctx = _context([3, 1, 2], [2, 0, 2])
    assert ctx.row_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert ctx.row_adapter.tolist() == [2, 2, 2, 0, 2, 2]


def test_a_base_model_step_uses_no_adapter_and_its_rows_are_all_zero():
    ctx = _context([2, 3], [0, 0])
    assert ctx.row_adapter.tolist() == [0] * 5


def test_rows_are_grouped_by_adapter_in_ascending_order_neighbours_merged():
    ctx = _context([2, 1, 3, 2, 1], [3, 3, 0, 1, 3])
    assert ctx.adapter_ranges == {0: ((3, 6),), 1: ((6, 8),), 3: ((0, 3), (8, 9))}
    groups = ctx.adapter_groups
    assert [(g.adapter, g.ranges, g.rows.tolist()) for g in groups] == [
        (0, ((3, 6),), [3, 4, 5]),
        (1, ((6, 8),), [6, 7]),
        (3, ((0, 3), (8, 9)), [0, 1, 2, 8]),
    ]
    assert ctx.adapter_groups is groups  # computed once per step


def test_a_context_whose_lengths_disagree_is_refused():
    with pytest.raises(ValueError, match="2 request ids, 2 row starts"):
        StepContext(request_ids=(1, 2), row_starts=(0, 1), adapters=(0, 0), device=CPU)


# ----- the graphed context -----

def test_a_graphed_context_reads_its_static_buffer_and_refuses_host_grouping():
    ctx = StepContext.for_graph(4, CPU)
    assert ctx.graphed
    assert ctx.row_adapter.tolist() == [0, 0, 0, 0] and ctx.row_starts == (0, 1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="inside a captured graph read row_adapter"):
        ctx.adapter_groups  # noqa: B018 - the property raises


# ----- reaching the layers -----

def test_current_is_the_innermost_using_and_none_outside():
    outer, inner = _context([1], [0]), _context([2], [1])
    assert current() is None
    with using(outer):
        assert current() is outer
        with using(inner):
            assert current() is inner
        assert current() is outer
    assert current() is None


def test_using_restores_the_previous_context_when_the_forward_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with using(_context([1], [0])):
            raise RuntimeError("boom")
    assert current() is None


# ----- the adapter table -----

def test_the_table_maps_no_adapter_to_the_base_model_and_loaded_ones_from_one():
    table = AdapterTable(["math", "code"])
    assert [table.resolve(name) for name in ("", "math", "code")] == [0, 1, 2]


def test_an_adapter_the_table_does_not_hold_is_refused_naming_it_and_the_loaded_ones():
    with pytest.raises(UnknownAdapter, match="'my-lora' is not a loaded LoRA adapter \\(loaded: none"):
        AdapterTable().resolve("my-lora")
    with pytest.raises(UnknownAdapter, match="'code' is not a loaded LoRA adapter \\(loaded: 'math'"):
        AdapterTable(["math"]).resolve("code")


@pytest.mark.parametrize("names", [["a", "a"], [""]])
def test_adapter_names_are_unique_and_non_empty(names):
    with pytest.raises(ValueError, match="unique and non-empty"):
        AdapterTable(names)
