"""TGI's sharded-client merge rules (backends/v3/src/client/sharded_client.rs), with a fake client per rank.

Every rank answers differently here, so each test shows which rank's answer (or error) comes back.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.client import LIVENESS_ID
from tgi_vlm.router.sharded_client import ShardedClient, connect


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeRank:
    """One rank: records every call; answers `answers[method]` (an exception is raised instead)."""

    def __init__(self, rank: int, **answers):
        self.rank = rank
        self.url = f"unix:///fake-{rank}"
        self.answers = answers
        self.calls: list[tuple] = []

    def _answer(self, method: str, *args):
        self.calls.append((method, *args))
        answer = self.answers.get(method)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def info(self):
        return self._answer("info")

    async def health(self):
        return self._answer("health")

    async def service_discovery(self):
        return self._answer("service_discovery")

    async def clear_cache(self, batch_id=None):
        return self._answer("clear_cache", batch_id)

    async def filter_batch(self, batch_id, request_ids):
        return self._answer("filter_batch", batch_id, list(request_ids))

    async def warmup(self, request):
        return self._answer("warmup", request)

    async def prefill(self, batch, cached_batch=None):
        return self._answer("prefill", batch, cached_batch)

    async def decode(self, batches):
        return self._answer("decode", list(batches))

    async def close(self):
        self.calls.append(("close",))


def run(coroutine):
    return asyncio.run(coroutine)


def step(response_type, rank: int, request_ids: list[int], total_ns: int, concat_ns: int | None = None):
    """A rank's Prefill/Decode answer: Generations for `request_ids`, a batch naming its rank in max_tokens."""
    return response_type(
        generations=[pb.Generation(request_id=rid, tokens=pb.Tokens(ids=[10 * rank + rid % 1000])) for rid in request_ids],
        batch=pb.CachedBatch(id=5, request_ids=[1, 2, 3, 4], size=4, max_tokens=100 + rank),
        forward_ns=total_ns - 2, decode_ns=1 + rank, total_ns=total_ns, concat_ns=concat_ns,
    )


def test_info_health_and_filter_batch_take_the_last_ranks_answer():
    ranks = [FakeRank(r, info=pb.InfoResponse(block_size=16 * (r + 1)), health=pb.HealthResponse(),
                      filter_batch=pb.CachedBatch(id=9, max_tokens=r)) for r in range(3)]
    client = ShardedClient(ranks)
    assert run(client.info()).block_size == 48
    assert run(client.filter_batch(9, [2, 4])).max_tokens == 2
    assert run(client.health()) == pb.HealthResponse()
    for rank in ranks:  # each was asked
        assert rank.calls == [("info",), ("filter_batch", 9, [2, 4]), ("health",)]


def test_info_health_and_filter_batch_ignore_errors_of_other_ranks_but_raise_the_last_ones():
    broken = rpc_error(grpc.StatusCode.UNAVAILABLE, "rank 0 is gone")
    ok_last = ShardedClient([FakeRank(0, info=broken, filter_batch=broken),
                             FakeRank(1, info=pb.InfoResponse(block_size=32), filter_batch=pb.CachedBatch(id=3))])
    assert run(ok_last.info()).block_size == 32
    assert run(ok_last.filter_batch(3, [1])).id == 3
    last_broken = ShardedClient([FakeRank(0, health=pb.HealthResponse()),
                                 FakeRank(1, health=rpc_error(grpc.StatusCode.UNAVAILABLE, "rank 1 is gone"))])
    with pytest.raises(grpc.aio.AioRpcError, match="rank 1 is gone"):
        run(last_broken.health())


def test_clear_cache_goes_to_every_rank_and_raises_the_first_error_in_rank_order():
    ranks = [FakeRank(0), FakeRank(1, clear_cache=rpc_error(grpc.StatusCode.INTERNAL, "one")),
             FakeRank(2, clear_cache=rpc_error(grpc.StatusCode.INTERNAL, "two"))]
    with pytest.raises(grpc.aio.AioRpcError, match="one"):
        run(ShardedClient(ranks).clear_cache(7))
    assert [rank.calls for rank in ranks] == [[("clear_cache", 7)]] * 3


def warmup(supported: int | None, max_input: int, max_total: int) -> pb.WarmupResponse:
    return pb.WarmupResponse(max_supported_total_tokens=supported, max_input_tokens=max_input,
                             max_total_tokens=max_total)


@pytest.mark.parametrize(("answers", "expected"), [
    # The minimum of (max_supported_total_tokens, max_input_tokens, max_total_tokens), in that order.
    ([(5000, 100, 200), (4000, 300, 400), (4500, 50, 60)], (4000, 300, 400)),
    ([(4000, 100, 300), (4000, 100, 200)], (4000, 100, 200)),
    # Rust orders None before Some: a rank that does not report the total is the minimum.
    ([(4000, 100, 200), (None, 900, 900)], (None, 900, 900)),
])
def test_warmup_takes_the_smallest_answer(answers, expected):
    ranks = [FakeRank(r, warmup=warmup(*answer)) for r, answer in enumerate(answers)]
    request = pb.WarmupRequest(max_prefill_tokens=64)
    got = run(ShardedClient(ranks).warmup(request))
    supported = got.max_supported_total_tokens if got.HasField("max_supported_total_tokens") else None
    assert (supported, got.max_input_tokens, got.max_total_tokens) == expected
    assert all(rank.calls == [("warmup", request)] for rank in ranks)


def test_warmup_raises_the_first_error_in_rank_order():
    ranks = [FakeRank(0, warmup=warmup(10, 1, 2)), FakeRank(1, warmup=rpc_error(grpc.StatusCode.INTERNAL, "oom 1")),
             FakeRank(2, warmup=rpc_error(grpc.StatusCode.INTERNAL, "oom 2"))]
    with pytest.raises(grpc.aio.AioRpcError, match="oom 1"):
        run(ShardedClient(ranks).warmup(pb.WarmupRequest()))


@pytest.mark.parametrize("response_type", [pb.PrefillResponse, pb.DecodeResponse])
def test_steps_take_the_last_ranks_batch_and_its_generations_first_then_the_others_in_rank_order(response_type):
    # Three ranks own requests 1..4 by id % 3: rank 0 owns 3, rank 1 owns 1 and 4, rank 2 owns 2.
    owned = {0: [3], 1: [1, 4], 2: [2]}
    ranks = [FakeRank(r, prefill=step(response_type, r, owned[r], total_ns=50),
                      decode=step(response_type, r, owned[r], total_ns=50)) for r in range(3)]
    client = ShardedClient(ranks)
    batch, cached = pb.Batch(id=5), pb.CachedBatch(id=4)
    merged = run(client.prefill(batch, cached) if response_type is pb.PrefillResponse else client.decode([cached]))
    assert type(merged) is response_type
    assert [(g.request_id, list(g.tokens.ids)) for g in merged.generations] == [(2, [22]), (3, [3]), (1, [11]),
                                                                                (4, [14])]
    assert merged.batch.max_tokens == 102  # the last rank's cached batch
    expected_call = ("prefill", batch, cached) if response_type is pb.PrefillResponse else ("decode", [cached])
    assert all(rank.calls == [expected_call] for rank in ranks)


def test_steps_report_the_timings_of_the_slowest_rank():
    ranks = [FakeRank(0, decode=step(pb.DecodeResponse, 0, [], total_ns=90, concat_ns=7)),
             FakeRank(1, decode=step(pb.DecodeResponse, 1, [], total_ns=40)),
             FakeRank(2, decode=step(pb.DecodeResponse, 2, [], total_ns=90))]
    merged = run(ShardedClient(ranks).decode([pb.CachedBatch(id=1)]))
    # Ranks 0 and 2 tie: TGI starts from the last rank and moves only to a strictly slower one.
    assert (merged.forward_ns, merged.decode_ns, merged.total_ns) == (88, 3, 90)
    assert not merged.HasField("concat_ns")
    ranks[0].answers["decode"] = step(pb.DecodeResponse, 0, [], total_ns=91, concat_ns=7)
    merged = run(ShardedClient(ranks).decode([pb.CachedBatch(id=1)]))
    assert (merged.forward_ns, merged.decode_ns, merged.total_ns, merged.concat_ns) == (89, 1, 91, 7)


def test_a_step_refused_by_any_rank_raises_the_first_refusal_in_rank_order():
    refusal = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "Prefill refused: request 3: bad image")
    ranks = [FakeRank(0, prefill=step(pb.PrefillResponse, 0, [2], total_ns=5)),
             FakeRank(1, prefill=refusal),
             FakeRank(2, prefill=rpc_error(grpc.StatusCode.UNAVAILABLE, "rank 2 is gone"))]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(ShardedClient(ranks).prefill(pb.Batch(id=1)))
    assert caught.value is refusal
    assert all(len(rank.calls) == 1 for rank in ranks)  # every rank got the call before the error came back


def test_the_liveness_prefill_goes_to_every_rank():
    ranks = [FakeRank(r, prefill=step(pb.PrefillResponse, r, [LIVENESS_ID] if LIVENESS_ID % 2 == r else [], 3))
             for r in range(2)]
    merged = run(ShardedClient(ranks).liveness())
    assert [g.request_id for g in merged.generations] == [LIVENESS_ID]
    for rank in ranks:
        ((method, batch, cached),) = rank.calls
        (request,) = batch.requests
        assert (method, cached, batch.id, batch.size, batch.max_tokens, batch.max_blocks) == (
            "prefill", None, 2**64 - 1, 1, 2, 1)
        assert (request.id, request.truncate, list(request.blocks), list(request.slots)) == (2**64 - 1, 1, [0], [0])
        assert (request.stopping_parameters.max_new_tokens, request.add_special_tokens) == (1, False)
        assert [c.text for c in request.input_chunks.chunks] == ["liveness"]


def test_service_discovery_asks_rank_0():
    ranks = [FakeRank(0, service_discovery=["unix:///a-0", "unix:///a-1"]), FakeRank(1, service_discovery=["x"])]
    assert run(ShardedClient(ranks).service_discovery()) == ["unix:///a-0", "unix:///a-1"]
    assert ranks[1].calls == []


def test_connect_asks_rank_0_for_the_ranks_and_gives_a_plain_client_for_one(monkeypatch):
    import tgi_vlm.router.sharded_client as module

    listed = {"/tmp/s-0": ["unix:///tmp/s-0", "unix:///tmp/s-1"], "/tmp/one-0": ["unix:///tmp/one-0"]}
    made: list[FakeRank] = []

    def fake_client(path_or_url: str) -> FakeRank:
        rank = FakeRank(len(made), service_discovery=listed.get(path_or_url))
        rank.url = path_or_url
        made.append(rank)
        return rank

    monkeypatch.setattr(module, "ShardClient", fake_client)
    sharded = run(connect("/tmp/s-0"))
    assert isinstance(sharded, ShardedClient)
    assert [c.url for c in sharded.clients] == ["unix:///tmp/s-0", "unix:///tmp/s-1"]
    assert made[0].calls == [("service_discovery",), ("close",)]  # the discovery channel is closed
    single = run(connect("/tmp/one-0"))
    assert single is made[-1] and single.calls == [("service_discovery",)]
