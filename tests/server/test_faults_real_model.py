"""Faults inside a forward of a real (tiny VLM) model: only that call's batches fail, their memory
is returned, and the shard keeps serving with correct tokens."""

from __future__ import annotations

import grpc

from tests.conftest import load_engine
from tests.models.vlm_reference import hf_reference
from tests.server.rpc_harness import rpc_error, run, running_shard
from tgi_vlm.pb import generate_pb2
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import make_batch, make_request

PROMPT = ("Look at ", png_bytes(make_test_image(20, 20, seed=1)), " and describe it")


def _tokens(response) -> dict[int, list[int]]:
    return {g.request_id: list(g.tokens.ids) for g in response.generations}


async def _generate(stub, batch_id: int, request_id: int, n: int) -> list[int]:
    response = await stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(batch_id, [make_request(request_id, *PROMPT, max_new_tokens=n)])))
    tokens = _tokens(response)[request_id]
    cached = response.batch
    while response.HasField("batch"):
        response = await stub.Decode(generate_pb2.DecodeRequest(batches=[cached]))
        tokens += _tokens(response).get(request_id, [])
        cached = response.batch
    return tokens


def fail_in_the_language_model(engine, exc: Exception, seen: list[tuple[int, int]]):
    """Raise `exc` from the language model, after the step's images were encoded into the encoder
    cache; `seen` gets (server blocks held, encoder entries) at that moment."""

    def hook(module, args, kwargs):
        seen.append((engine.kv_blocks_in_use, engine.encoder_cache.num_entries))
        raise exc

    return engine.language_model.register_forward_pre_hook(hook, with_kwargs=True)


def test_exception_in_forward_fails_only_that_call_and_frees_memory():
    engine = load_engine("qwen2_vl")
    expected = hf_reference("qwen2_vl", PROMPT, 5).ids

    async def scenario_with_recovery():
        async with running_shard(engine) as shard:
            stub = shard.stub
            first = await stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(1, [make_request(1, *PROMPT, max_new_tokens=5)])))
            seen: list[tuple[int, int]] = []
            hook = fail_in_the_language_model(engine, RuntimeError("CUDA out of memory (injected)"), seen)
            err = await rpc_error(stub.Decode(generate_pb2.DecodeRequest(batches=[first.batch])))
            hook.remove()
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "batch(es) [1]" in err.details() and "released" in err.details()
            hook = fail_in_the_language_model(engine, ValueError("injected bug"), seen)
            err = await rpc_error(stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(2, [make_request(2, *PROMPT, max_new_tokens=5)]))))
            hook.remove()
            assert err.code() == grpc.StatusCode.INTERNAL
            # Held when each forward failed: batch 1's blocks (its image long done), then batch 2's and its image.
            blocks = seen[0][0]
            assert blocks > 0 and seen == [(blocks, 0), (blocks, 1)]
            assert engine.kv_blocks_in_use == 0 and engine.encoder_cache.num_entries == 0
            assert len(shard.service.cache) == 0
            not_found = await rpc_error(stub.Decode(generate_pb2.DecodeRequest(batches=[first.batch])))
            assert not_found.code() == grpc.StatusCode.NOT_FOUND
            assert await _generate(stub, 3, 3, 5) == expected  # the shard keeps serving, correctly
            assert engine.kv_blocks_in_use == 0 and engine.encoder_cache.num_entries == 0

    run(scenario_with_recovery, timeout=120)


def test_invalid_new_batch_leaves_the_cached_batch_untouched():
    engine = load_engine("qwen2_vl")
    expected = hf_reference("qwen2_vl", PROMPT, 6).ids

    async def scenario():
        async with running_shard(engine) as shard:
            stub = shard.stub
            response = await stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(1, [make_request(1, *PROMPT, max_new_tokens=6)])))
            tokens = _tokens(response)[1]
            bad = make_batch(2, [make_request(2, *PROMPT), make_request(3, "broken ", b"\x89PNG\r\n\x1a\n garbage")])
            err = await rpc_error(stub.Prefill(generate_pb2.PrefillRequest(batch=bad, cached_batch=response.batch)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request 3" in err.details() and "request 2" not in err.details()
            cached = response.batch
            while True:  # the cached batch is still there and decodes to the right tokens
                response = await stub.Decode(generate_pb2.DecodeRequest(batches=[cached]))
                tokens += _tokens(response).get(1, [])
                if not response.HasField("batch"):
                    break
                cached = response.batch
            assert tokens == expected
            assert engine.kv_blocks_in_use == 0 and engine.encoder_cache.num_entries == 0

    run(scenario, timeout=120)
