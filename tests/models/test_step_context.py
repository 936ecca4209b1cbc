"""A request's adapter through the engine (tiny llama): intake records `adapter_id` and its index,
every layer sees the step context during the forward (eagerly and through the CUDA-graph stand-in,
whose static adapter buffer is refilled per replay), and prefix-cache keys live in the adapter's
namespace on the shard exactly as the driver computes them."""

from __future__ import annotations

import pytest

from tests.models.prefix_routing import common_blocks
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.layers.step_context import current
from tgi_vlm.models.adapter_table import AdapterTable
from tgi_vlm.models.cuda_graphs import DecodeGraphs
from tgi_vlm.router.prefix_cache import prompt_blocks
from tgi_vlm.testing.harness import Runner, make_batch, make_request

SYSTEM = ("You are a helpful assistant that answers questions about pictures and words. "
          "Keep every answer short, kind and correct. ")
Q1, Q2 = "What is the color of the sky?", "Tell me about dogs please."


@pytest.fixture(scope="module")
def arch():
    return "llama"


@pytest.fixture
def adapters(engine, monkeypatch):
    """Two adapters in the table without weights (no layer has an extra term: tokens stay the base model's)."""
    monkeypatch.setattr(engine, "adapter_table", AdapterTable(["lora-a", "lora-b"]))


def with_adapter(request, adapter_id: str):
    if adapter_id:
        request.adapter_id = adapter_id
    return request


# ----- intake -----

def test_intake_records_the_adapter_id_and_its_index_and_filter_and_concatenate_keep_them(engine, runner, adapters):
    runner.prefill([with_adapter(make_request(1, "one", max_new_tokens=4), "lora-b"),
                    make_request(2, "two", max_new_tokens=4)])
    runner.prefill([with_adapter(make_request(3, "three", max_new_tokens=4), "lora-a")], batch_id=2)
    assert [(s.request_id, s.adapter_id, s.adapter_index) for s in runner.batch.seqs] == [
        (1, "lora-b", 2), (2, "", 0), (3, "lora-a", 1)]
    runner.filter([1, 3])
    assert [(s.adapter_id, s.adapter_index) for s in runner.batch.seqs] == [("lora-b", 2), ("lora-a", 1)]
    runner.run()


def test_an_adapter_the_table_does_not_hold_refuses_that_request_only(engine, adapters):
    batch = make_batch(1, [make_request(1, SYSTEM + Q1, max_new_tokens=5),
                           with_adapter(make_request(2, SYSTEM + Q1, max_new_tokens=5), "not-loaded")])
    with pytest.raises(InvalidBatch, match="request 2: adapter_id 'not-loaded' is not a loaded LoRA adapter") as refused:
        engine.batch_from_pb(batch)
    assert refused.value.request_ids == [2] and engine.kv_blocks_in_use == 0


# ----- the layers see the step context -----

@pytest.fixture
def seen(engine):
    """What a layer deep in the language model reads from `current()` at every forward."""
    records = []

    def probe(module, args):
        ctx = current()
        records.append(None if ctx is None else (ctx.graphed, ctx.row_starts, ctx.row_adapter.tolist()))

    handle = engine.language_model.norm.register_forward_pre_hook(probe)
    yield records
    handle.remove()


def test_every_forward_runs_inside_its_step_context(engine, runner, adapters, seen):
    a, b = (make_request(1, "Hello there", max_new_tokens=2), make_request(2, "a longer prompt here", max_new_tokens=2))
    runner.prefill([with_adapter(a, "lora-b"), b])
    n1, n2 = (len(engine.tokenize_request(r).ids) for r in (a, b))
    runner.run()
    assert seen == [(False, (0, n1, n1 + n2), [2] * n1 + [0] * n2),  # the prefill: one row per prompt token
                    (False, (0, 1, 2), [2, 0])]  # the decode step
    assert current() is None  # nothing left set after the step


def test_a_graph_replay_reads_the_static_adapter_buffer_refilled_for_the_step(engine, runner, adapters, seen):
    engine.graphs = DecodeGraphs.eager(engine, (4,), max_kv_len=64)
    try:
        runner.prefill([with_adapter(make_request(1, "Hello there", max_new_tokens=3), "lora-a"),
                        with_adapter(make_request(2, "x", max_new_tokens=3), "lora-b"),
                        make_request(3, "third one here", max_new_tokens=3)])
        runner.run()
    finally:
        engine.graphs = None
    # 2 decode steps replay size 4: sequences 0..2 then one padding row on the base model
    assert seen[1:] == [(True, (0, 1, 2, 3, 4), [1, 2, 0, 0])] * 2


# ----- prefix keys in the adapter's namespace -----

def test_the_shard_keys_a_requests_blocks_as_the_driver_does_for_its_adapter(engine, runner, adapters):
    request = with_adapter(make_request(1, SYSTEM + Q1, max_new_tokens=3), "lora-a")
    ids = engine.tokenize_request(request).ids
    runner.prefill([request])
    shard_keys = runner.batch.seqs[0].block_keys
    driver_keys = list(prompt_blocks(ids, [], None, engine.config.block_size, adapter_id="lora-a").keys)
    assert len(driver_keys) == len(ids) // 16 >= 2 and shard_keys[: len(driver_keys)] == driver_keys
    assert driver_keys != list(prompt_blocks(ids, [], None, engine.config.block_size).keys)
    runner.run()


def _prefilled_blocks(runner, routed, rid: int, text: str, adapter_id: str) -> list[int]:
    request = with_adapter(routed.request(rid, (text,), 3), adapter_id)
    runner.prefill([request])
    runner.run()
    return list(request.blocks)


def test_a_claim_on_blocks_another_adapters_request_computed_is_refused(engine, runner, routed, adapters):
    blocks = _prefilled_blocks(runner, routed, 1, SYSTEM + Q1, "lora-a")
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q2,)), 16)
    assert k >= 2
    for other in ("lora-b", ""):
        claim = with_adapter(routed.request(2, (SYSTEM + Q2,), 3, prefix_blocks=blocks[:k], cache_len=k * 16), other)
        with pytest.raises(InvalidBatch, match="request 2: .*holds other content"):
            engine.batch_from_pb(make_batch(9, [claim]))


def test_a_claim_by_a_request_of_the_same_adapter_is_served(engine, runner, routed, computed, adapters):
    blocks = _prefilled_blocks(runner, routed, 1, SYSTEM + Q1, "lora-a")
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q2,)), 16)
    assert k >= 2
    plain = Runner(engine)
    plain.prefill([make_request(3, SYSTEM + Q2, max_new_tokens=3)])
    plain.run()
    computed.clear()
    runner.prefill([with_adapter(routed.request(2, (SYSTEM + Q2,), 3, prefix_blocks=blocks[:k], cache_len=k * 16),
                                 "lora-a")])
    runner.run()
    assert computed[0] == len(routed.prompt_ids((SYSTEM + Q2,))) - k * 16
    assert runner.tokens[2] == plain.tokens[3]
