"""Each RPC of the shard service, through a real gRPC server, with a fake engine."""

from __future__ import annotations

import asyncio

import grpc

from tests.server.fake_model import FakeModel
from tests.server.rpc_harness import cached, make_batch, rpc_error, run, running_shard
from tgi_vlm.pb import generate_pb2 as pb


def test_info_returns_the_model_info():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            info = await shard.stub.Info(pb.InfoRequest())
            assert (info.requires_padding, info.dtype, info.device_type) == (False, "float32", "cpu")
            assert (info.block_size, info.support_chunking, info.attention_impl) == (16, True, "torch")
            assert not info.HasField("window_size")

    run(scenario)


def test_service_discovery_lists_the_socket_of_every_rank():
    async def scenario():
        async with running_shard(FakeModel(), world_size=3) as shard:
            response = await shard.stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
            base = shard.config.uds_path
            assert list(response.urls) == [f"unix://{base}-0", f"unix://{base}-1", f"unix://{base}-2"]

    run(scenario)


def test_a_rank_answers_generations_only_for_the_requests_it_owns_and_keeps_the_whole_batch():
    async def scenario():
        async with running_shard(FakeModel(), world_size=3, rank=1) as shard:
            assert shard.config.socket_url().endswith("/s-1")
            prefill = await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(7, [1, 2, 3, 4, 7], max_new_tokens=2)))
            assert [(g.request_id, list(g.tokens.ids)) for g in prefill.generations] == [(1, [100]), (4, [400]),
                                                                                        (7, [700])]
            assert list(prefill.batch.request_ids) == [1, 2, 3, 4, 7]
            decode = await shard.stub.Decode(pb.DecodeRequest(batches=[prefill.batch]))
            assert [g.request_id for g in decode.generations] == [1, 4, 7]
            assert [g.generated_text.generated_tokens for g in decode.generations] == [2, 2, 2]
            assert not decode.HasField("batch")  # every request finished, owned or not

    run(scenario)


def test_health_answers():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            assert await shard.stub.Health(pb.HealthRequest()) == pb.HealthResponse()

    run(scenario)


def test_warmup_returns_the_model_limits_and_echoes_the_requested_ones():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            request = pb.WarmupRequest(batch=make_batch(0, [0]), max_input_tokens=50, max_prefill_tokens=64,
                                       max_total_tokens=80)
            response = await shard.stub.Warmup(request)
            assert (response.max_supported_total_tokens, response.max_input_tokens, response.max_total_tokens) == (
                4096, 50, 80)

    run(scenario)


def test_prefill_returns_one_generation_per_request_and_caches_the_batch():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            response = await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(7, [1, 2])))
            assert [(g.request_id, list(g.tokens.ids)) for g in response.generations] == [(1, [100]), (2, [200])]
            assert (response.batch.id, list(response.batch.request_ids), response.batch.size) == (7, [1, 2], 2)
            assert (response.forward_ns, response.decode_ns) == (11, 22)
            assert response.total_ns > 0 and not response.HasField("concat_ns")
            assert shard.service.cache.ids() == [7]

    run(scenario)


def test_prefill_with_a_cached_batch_concatenates_cached_then_new():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [10])))
            response = await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(2, [20]), cached_batch=cached(1)))
            assert model.forwards[-1] == [10, 20]
            assert [list(g.tokens.ids) for g in response.generations] == [[1001], [2000]]
            assert (response.batch.id, list(response.batch.request_ids)) == (1, [10, 20])
            assert response.HasField("concat_ns")
            assert shard.service.cache.ids() == [1]

    run(scenario)


def test_decode_runs_one_step_of_a_cached_batch():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [3])))
            response = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            assert [list(g.tokens.ids) for g in response.generations] == [[301]]
            assert response.batch.id == 1 and not response.HasField("concat_ns")

    run(scenario)


def test_decode_of_two_batches_concatenates_them_in_order():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1])))
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(2, [2])))
            response = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1), cached(2)]))
            assert model.forwards[-1] == [1, 2]
            assert (response.batch.id, list(response.batch.request_ids)) == (1, [1, 2])
            assert response.HasField("concat_ns") and shard.service.cache.ids() == [1]

    run(scenario)


def test_the_last_step_returns_generated_text_no_batch_and_releases_the_batch():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [4], max_new_tokens=2)))
            response = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            assert response.generations[0].generated_text.text == "t401"
            assert not response.HasField("batch")
            assert shard.service.cache.ids() == [] and model.released == [1]

    run(scenario)


def test_filter_batch_keeps_only_the_listed_requests():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1, 2, 3])))
            response = await shard.stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[1, 3]))
            assert (response.batch.id, list(response.batch.request_ids), response.batch.size) == (1, [1, 3], 2)
            decoded = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            assert [g.request_id for g in decoded.generations] == [1, 3]

    run(scenario)


def test_filter_batch_with_ids_not_in_the_batch_is_invalid_argument_naming_them():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1, 2])))
            error = await rpc_error(shard.stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[2, 8, 9])))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "[8, 9]" in error.details() and "batch 1" in error.details()
            assert list(shard.service.cache.get(1).request_ids) == [1, 2]

    run(scenario)


def test_unknown_batch_ids_are_not_found():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            calls = [
                shard.stub.FilterBatch(pb.FilterBatchRequest(batch_id=5, request_ids=[1])),
                shard.stub.Decode(pb.DecodeRequest(batches=[cached(5)])),
                shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(6, [1]), cached_batch=cached(5))),
            ]
            for call in calls:
                error = await rpc_error(call)
                assert error.code() == grpc.StatusCode.NOT_FOUND and "batch 5" in error.details()
            assert model.built == []  # the unknown cached batch is found out before the new one is built
            assert model.released == [] and model.forwards == []

    run(scenario)


def test_decode_with_one_unknown_id_leaves_the_cache_unchanged():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1])))
            error = await rpc_error(shard.stub.Decode(pb.DecodeRequest(batches=[cached(1), cached(9)])))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert shard.service.cache.ids() == [1]
            await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))

    run(scenario)


def test_decode_with_no_batches_is_invalid_argument():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            error = await rpc_error(shard.stub.Decode(pb.DecodeRequest()))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no batches" in error.details()

    run(scenario)


def test_clear_cache_drops_one_batch_or_all_and_ignores_unknown_ids():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            for batch_id in (1, 2, 3):
                await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(batch_id, [batch_id])))
            await shard.stub.ClearCache(pb.ClearCacheRequest(id=2))
            assert shard.service.cache.ids() == [1, 3] and model.released == [2]
            await shard.stub.ClearCache(pb.ClearCacheRequest(id=42))
            await shard.stub.ClearCache(pb.ClearCacheRequest())
            assert shard.service.cache.ids() == [] and sorted(model.released) == [1, 2, 3]

    run(scenario)


def test_a_failing_forward_is_internal_releases_its_batches_and_the_shard_keeps_serving():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1])))
            model.fail_next_forward = RuntimeError("kernel exploded")
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(2, [2]),
                                                                         cached_batch=cached(1))))
            assert error.code() == grpc.StatusCode.INTERNAL and "kernel exploded" in error.details()
            assert model.released == [1] and shard.service.cache.ids() == []  # the concatenation, id 1
            response = await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(3, [3])))
            assert response.batch.id == 3

    run(scenario)


def test_out_of_memory_in_a_forward_is_resource_exhausted():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            model.fail_next_forward = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1]))))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert model.released == [1] and shard.service.cache.ids() == []

    run(scenario)


def test_an_invalid_new_batch_leaves_the_cached_batch_in_the_cache_unchanged():
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1, 2])))
            bad = make_batch(2, [5])
            bad.requests[0].inputs = "bad"
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=bad, cached_batch=cached(1))))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "request 5" in error.details()
            assert shard.service.cache.ids() == [1] and model.released == []
            response = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            assert [list(g.tokens.ids) for g in response.generations] == [[101], [201]]

    run(scenario)


def test_health_answers_while_a_forward_is_running():
    async def scenario():
        model = FakeModel()
        model.forward_may_finish.clear()
        async with running_shard(model) as shard:
            prefill = asyncio.ensure_future(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1]))))
            assert await asyncio.to_thread(model.forward_started.wait, 10)
            await asyncio.wait_for(shard.stub.Health(pb.HealthRequest()), 5)
            assert not prefill.done()
            model.forward_may_finish.set()
            assert (await prefill).batch.id == 1

    run(scenario)


def test_a_cached_batch_left_by_a_refused_prefill_is_released_unless_the_next_call_names_it():
    """TGI's router fails every request after a refused Prefill(new, cached) and never names that
    batch again; our driver resends the good requests with it. Both must end with nothing leaked."""

    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1])))
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(5, [5])))  # another batch, never involved
            bad = make_batch(2, [2], inputs="bad")  # the fake model refuses it
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=bad, cached_batch=cached(1))))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert shard.service.cache.ids() == [1, 5]  # untouched by the refusal
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(3, [3]), cached_batch=cached(1)))
            assert shard.service.cache.ids() == [5, 1] and model.released == []  # resumed: named by the next call

            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=bad, cached_batch=cached(1))))
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(4, [4])))  # TGI-style: a fresh batch
            assert model.released == [1]  # exactly the refused Prefill's cached batch
            assert shard.service.cache.ids() == [5, 4]

    run(scenario)


def test_prefill_refuses_ids_that_would_make_the_cache_ambiguous():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1, 2])))
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [5]))))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "already cached" in error.details()
            error = await rpc_error(shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(2, [2]), cached_batch=cached(1))))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "[2]" in error.details()
            assert shard.service.cache.ids() == [1]

    run(scenario)


def test_the_model_gives_back_idle_memory_only_once_no_batch_is_left():
    """A batch finishing while another is cached (e.g. TGI's liveness Prefill next to the running batch)
    must not make the model drop state the running batch uses; the last one finishing, or ClearCache, does."""
    async def scenario():
        model = FakeModel()
        async with running_shard(model) as shard:
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [10], max_new_tokens=3)))
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(2, [20], max_new_tokens=1)))  # done at once
            assert model.idle_releases == 0 and shard.service.cache.ids() == [1]
            await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            response = await shard.stub.Decode(pb.DecodeRequest(batches=[cached(1)]))
            assert not response.HasField("batch") and model.idle_releases == 1
            await shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(3, [30], max_new_tokens=5)))
            await shard.stub.ClearCache(pb.ClearCacheRequest(id=3))
            assert model.idle_releases == 2

    run(scenario)
