"""A real shard process (console script, tiny Qwen2-VL) driven through the router, as TGI's would.

One shard serves the module; every test warms it up again through its own router and ends with
the router's block allocator full again (every block freed).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.e2e.driving import drive_router, tokens_of
from tests.models.vlm_reference import hf_reference
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router import (
    RequestParams,
    Router,
    ShardClient,
    ShardProcess,
    TokenCounter,
)
from tgi_vlm.router.tokens import CountError
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path

ARCH = "qwen2_vl"
SHARD_ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0"}


def image(width: int, height: int, seed: int) -> bytes:
    return png_bytes(make_test_image(width, height, seed=seed))


# Different images, prompt lengths, output lengths and sampling settings.
REQUESTS = [
    RequestParams([image(56, 56, 1), "what is in the picture?"], max_new_tokens=12, ignore_eos=True),
    RequestParams(["compare ", image(90, 40, 2), " with the sea and the sky and the hills"], max_new_tokens=7,
                  ignore_eos=True),
    RequestParams([image(32, 80, 3), "a story"], max_new_tokens=10, ignore_eos=True, do_sample=True, seed=7,
                  temperature=0.8, top_k=20, top_p=0.9),
    RequestParams([image(64, 48, 4), "colors?"], max_new_tokens=9, ignore_eos=True, repetition_penalty=1.3),
    RequestParams(["no image at all, just words"], max_new_tokens=6, ignore_eos=True, do_sample=True, seed=3),
]
GREEDY = [0, 1]  # plain greedy requests, also checked against transformers' generate


class CountingClient:
    """ShardClient that counts RPCs and can hold Decode calls until `gate` is set."""

    def __init__(self, client: ShardClient):
        self.client = client
        self.calls: Counter[str] = Counter()
        self.prefills: list[tuple[list[int], bool]] = []  # (request ids, with a cached batch)
        self.gate = asyncio.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def prefill(self, batch, cached_batch=None):
        self.calls["prefill+cached" if cached_batch is not None else "prefill"] += 1
        self.prefills.append(([r.id for r in batch.requests], cached_batch is not None))
        return await self.client.prefill(batch, cached_batch)

    async def decode(self, batches):
        await self.gate.wait()
        self.calls["decode"] += 1
        return await self.client.decode(batches)


@pytest.fixture(scope="module")
def shard():
    with ShardProcess(str(tiny_model_path(ARCH)), env=SHARD_ENV, extra_args=FLOAT32_SHARD_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(str(tiny_model_path(ARCH)))


def run_with_router(shard, count_tokens, scenario, timeout: float = 60.0):
    """Run `scenario(router, client)` against a fresh router over the module's shard; check blocks come back."""
    return drive_router(shard.socket, count_tokens, scenario, client=CountingClient, timeout=timeout)


async def alone(router: Router, params: RequestParams) -> list[int]:
    ids, final = await tokens_of(await router.submit(params))
    assert final.ok, final.error
    return ids


def test_concurrent_requests_get_exactly_the_tokens_each_gets_alone(shard, counter):
    async def scenario(router, client):
        solo = [await alone(router, p) for p in REQUESTS]
        streams = [await router.submit(p) for p in REQUESTS]
        together = [await tokens_of(s) for s in streams]
        return solo, together

    solo, together = run_with_router(shard, counter.count, scenario)
    for params, ids, (batched, final) in zip(REQUESTS, solo, together):
        assert final.ok and final.generated_tokens == params.max_new_tokens == len(ids)
        assert batched == ids
    for i in GREEDY:
        ref = hf_reference(ARCH, tuple(REQUESTS[i].chunks), REQUESTS[i].max_new_tokens)
        assert solo[i] == ref.ids, f"request {i}: {solo[i]} != transformers {ref.ids}"


def test_requests_arriving_during_decode_join_the_running_batch(shard, counter):
    long_one = RequestParams([image(48, 48, 5), "keep talking"], max_new_tokens=24, ignore_eos=True)

    async def scenario(router, client):
        solo = [await alone(router, p) for p in (long_one, *REQUESTS[:3])]
        client.calls.clear()
        first = await router.submit(long_one)
        await first.entry.events.get()  # its first token: the batch is decoding
        joined = await asyncio.gather(*[router.submit(p) for p in REQUESTS[:3]])
        outputs = [await tokens_of(s) for s in (first, *joined)]
        return solo, outputs, dict(client.calls)

    solo, outputs, calls = run_with_router(shard, counter.count, scenario)
    assert calls["prefill"] == 1 and calls["prefill+cached"] >= 1, calls
    assert outputs[0][0] == solo[0][1:]  # the first token was taken off the stream above
    for ids, (batched, final) in zip(solo[1:], outputs[1:]):
        assert final.ok and batched == ids


def test_cancelled_requests_leave_and_free_their_blocks(shard, counter):
    params = [RequestParams([image(40 + 8 * i, 40, 10 + i), f"cancel test {i}"], max_new_tokens=30, ignore_eos=True)
              for i in range(3)]

    async def scenario(router, client):
        solo = await alone(router, params[2])
        streams = [await router.submit(p) for p in params]
        await streams[0].entry.events.get()
        assert router.cancel(streams[0].request_id)  # running
        assert router.cancel(streams[1].request_id)
        assert not router.cancel(10_000)
        results = [await tokens_of(s) for s in streams]
        return solo, results

    solo, results = run_with_router(shard, counter.count, scenario)
    for _, final in results[:2]:
        assert final.cancelled and final.error == "cancelled"
    assert results[2][1].ok and results[2][0] == solo


def test_shard_refuses_a_corrupt_image_mid_batch_and_the_others_finish(shard, counter):
    corrupt = image(30, 30, 0)[:60]

    def lenient(request: pb.Request) -> int:  # let the bad request reach the shard instead of failing here
        try:
            return counter.count(request)
        except CountError:
            return 40

    running = REQUESTS[:2]
    joining = [REQUESTS[3], RequestParams(["bad ", corrupt, " image"], max_new_tokens=4), REQUESTS[4]]

    async def scenario(router, client):
        solo = [await alone(router, p) for p in (*running, joining[0], joining[2])]
        client.prefills.clear()
        client.gate.clear()  # hold Decode: the running batch waits while all three joiners queue up
        streams = [await router.submit(p) for p in running]
        await streams[0].entry.events.get()
        streams += [await router.submit(p) for p in joining]
        client.gate.set()
        outputs = [await tokens_of(s) for s in streams]
        return solo, outputs, client.prefills

    solo, outputs, prefills = run_with_router(shard, lenient, scenario)
    bad_id = outputs[3][1].request_id
    assert not outputs[3][1].ok and f"request {bad_id}:" in outputs[3][1].error
    assert "corrupt or truncated image" in outputs[3][1].error
    c, d, e = (outputs[i][1].request_id for i in (2, 3, 4))
    refused = prefills.index(([c, d, e], True))  # all three joined the running batch in one Prefill ...
    assert prefills[refused + 1] == ([c, e], True)  # ... and the good ones were resent with it
    good = [outputs[1], outputs[2], outputs[4]]
    assert outputs[0][0] == solo[0][1:]
    for ids, (batched, final) in zip(solo[1:], good):
        assert final.ok and batched == ids
