"""Router-given KV slots are bounds-checked at every edge, before any forward (README, "What the
shard trusts": "slots given by the router are bounds-checked").

A real tiny engine is served on a socket in this process with an 8-block KV cache, so the edge is
`num_slots` = 8 × 16 = 128. A request needs `prompt + max_new_tokens - 1` slots (the last generated
token is never fed back); each one, wherever it sits, must be `< num_slots`. A refusal is
INVALID_ARGUMENT naming the request, sent alongside a good request; no forward may run (counted by
a hook on the transformers module) and the KV cache tensors must be bit-identical afterwards.
Accepted edges (slot `num_slots - 1`, block `num_blocks - 1`, exactly as many slots as needed)
must generate the same tokens as server-allocated blocks.

Negative slots cannot arrive: `slots` is `repeated uint32`; a -1 written on the wire as a 64-bit
varint parses as 2**32 - 1, which is refused like any other slot past the end.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.conftest import load_engine
from tests.server.rpc_harness import rpc_error, run, running_shard
from tgi_vlm.models.flash_causal_lm import LIVENESS_BATCH_ID
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.testing.harness import make_batch, make_request

NUM_BLOCKS = 8
PROMPT = "hello world this is"
MAX_NEW = 4
BAD, GOOD = 7, 1


@pytest.fixture(scope="module")
def engine():
    model = load_engine("llama")
    model.allocate_kv_cache(NUM_BLOCKS)
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    model.forward_calls = calls
    return model


@pytest.fixture(scope="module")
def bs(engine) -> int:
    return engine.config.block_size


@pytest.fixture(scope="module")
def num_slots(engine) -> int:
    assert engine.kv_cache.num_slots == NUM_BLOCKS * engine.config.block_size
    return engine.kv_cache.num_slots


@pytest.fixture(scope="module")
def needed(engine, bs) -> int:
    n = len(engine.tokenizer(PROMPT)["input_ids"]) + MAX_NEW - 1
    assert MAX_NEW < n < bs  # the cases below put the prompt and decode positions in one block
    return n


def serve(engine, requests: list[pb.Request], batch_id: int = 1) -> dict[int, list[int]]:
    """Prefill, then Decode until every request finishes; the tokens of each request."""
    tokens: dict[int, list[int]] = {}

    async def scenario():
        async with running_shard(engine) as shard:
            response = await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(batch_id, requests)))
            while True:
                for g in response.generations:
                    tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
                if not response.HasField("batch"):
                    break
                response = await shard.stub.Decode(pb.DecodeRequest(batches=[response.batch]))

    run(scenario)
    assert engine.kv_blocks_in_use == 0
    return tokens


def refused(engine, requests: list[pb.Request], batch_id: int = 1) -> grpc.aio.AioRpcError:
    """The Prefill error; asserts that no forward ran and the KV cache is bit-identical."""
    kv = engine.kv_cache
    before = [t.clone() for t in kv.keys + kv.values]
    calls = len(engine.forward_calls)
    box = []

    async def scenario():
        async with running_shard(engine) as shard:
            box.append(await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(batch_id, requests)))))
            assert shard.service.cache.ids() == []

    run(scenario)
    assert len(engine.forward_calls) == calls, "a forward ran before the slots were checked"
    assert all(torch.equal(a, b) for a, b in zip(before, kv.keys + kv.values)), "the KV cache was written"
    assert engine.kv_blocks_in_use == 0, "the good request's blocks were not given back"
    return box[0]


def request(rid: int = BAD, *, slots=(), blocks=(), max_new_tokens: int = MAX_NEW) -> pb.Request:
    r = make_request(rid, PROMPT, max_new_tokens=max_new_tokens)
    r.slots[:] = list(slots)
    r.blocks[:] = list(blocks)
    return r


@pytest.fixture(scope="module")
def solo_tokens(engine) -> list[int]:
    tokens = serve(engine, [request(GOOD)])[GOOD]  # server-allocated blocks
    assert len(tokens) == MAX_NEW
    return tokens


def with_slot(needed: int, bs: int, position: int, value: int) -> list[int]:
    """`needed` in-range slots of block 1, with the one at `position` replaced by `value`."""
    slots = list(range(bs, bs + needed))
    slots[position] = value
    return slots


def assert_invalid(error: grpc.aio.AioRpcError, *fragments: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    details = error.details()
    assert f"request {BAD}" in details and f"request {GOOD}" not in details, details
    for fragment in fragments:
        assert fragment in details, details


# Positions of the one bad slot: the first prompt position, the first decode position (only a
# later slot is bad, so checking the prompt's or the first slot is not enough), the last needed
# position (checking slots[:needed - 1] is not enough).
@pytest.mark.parametrize("where", ["first", "first-decode", "last-needed"])
def test_a_slot_equal_to_num_slots_is_refused_before_any_forward(engine, bs, num_slots, needed, where):
    position = {"first": 0, "first-decode": needed - MAX_NEW + 1, "last-needed": needed - 1}[where]
    slots = with_slot(needed, bs, position, num_slots)
    assert max(slots[: needed - MAX_NEW + 1]) < num_slots or where == "first"
    error = refused(engine, [request(GOOD), request(slots=slots, blocks=[1])])
    assert_invalid(error, f"slot {num_slots}", "outside the KV cache")


def test_slot_num_slots_minus_one_is_used_and_serves_the_same_tokens(engine, num_slots, needed, solo_tokens):
    slots = list(range(num_slots - needed, num_slots))  # exactly `needed` slots, the last one is the cache's last
    layer0 = engine.kv_cache.flat(0)[0]
    layer0[num_slots - 1].zero_()
    assert serve(engine, [request(BAD, slots=slots, blocks=[NUM_BLOCKS - 1])])[BAD] == solo_tokens
    assert layer0[num_slots - 1].abs().sum() > 0, "the last needed position was not written to slot num_slots - 1"


def test_one_slot_fewer_than_needed_is_refused(engine, bs, needed):
    error = refused(engine, [request(GOOD), request(slots=range(bs, bs + needed - 1), blocks=[1])])
    assert_invalid(error, f"needs {needed} KV slots", f"gave {needed - 1}")


def test_the_largest_uint32_slot_is_refused(engine, bs, needed):
    error = refused(engine, [request(GOOD), request(slots=with_slot(needed, bs, needed // 2, 2**32 - 1), blocks=[1])])
    assert_invalid(error, f"slot {2**32 - 1}")


def test_a_negative_slot_cannot_be_built_and_arrives_from_the_wire_as_2_to_the_32_minus_1(engine, bs, needed):
    with pytest.raises(ValueError, match="Value out of range: -1"):
        pb.Request(slots=[-1])
    bad = request(slots=range(bs, bs + needed - 1), blocks=[1])
    # Field 10 (slots), wire type 0 (varint), value -1 as a ten-byte two's complement varint.
    wire = bad.SerializeToString() + bytes([10 << 3]) + b"\xff" * 9 + b"\x01"
    parsed = pb.Request.FromString(wire)
    assert list(parsed.slots)[-1] == 2**32 - 1 and len(parsed.slots) == needed
    assert_invalid(refused(engine, [request(GOOD), parsed]), f"slot {2**32 - 1}")


def test_a_block_equal_to_num_blocks_without_slots_is_refused(engine, num_slots):
    error = refused(engine, [request(GOOD), request(blocks=[NUM_BLOCKS])])
    assert_invalid(error, "outside the KV cache")


def test_a_later_block_out_of_range_without_slots_is_refused(engine, bs):
    # max_new_tokens = bs makes the request need two blocks; only the second is out of range.
    error = refused(engine, [request(GOOD), request(blocks=[1, NUM_BLOCKS], max_new_tokens=bs)])
    assert_invalid(error, "outside the KV cache")


def test_the_last_block_without_slots_serves_the_same_tokens(engine, solo_tokens):
    assert serve(engine, [request(BAD, blocks=[NUM_BLOCKS - 1])])[BAD] == solo_tokens


def test_a_liveness_batch_is_checked_too(engine, bs, num_slots, needed):
    error = refused(engine, [request(GOOD), request(slots=with_slot(needed, bs, needed - 1, num_slots), blocks=[0])],
                    batch_id=LIVENESS_BATCH_ID)
    assert_invalid(error, f"slot {num_slots}")


def test_the_refusal_names_the_needed_slot_that_is_out_of_range(engine, bs, num_slots, needed):
    # A slot past the needed ones is never written; the message must name the one that would be.
    slots = with_slot(needed, bs, needed - 1, num_slots) + [2**32 - 1]
    error = refused(engine, [request(GOOD), request(slots=slots, blocks=[1])])
    assert_invalid(error, f"slot {num_slots} is outside", f"({num_slots} slots)")
