"""A catalogue of bad inputs, each sent to a real shard process (tiny Qwen2-VL) alongside good
requests while another batch is decoding.

Request-level kinds go through the router driver: two requests are decoding, then a good one, the
odd one and another good one join in one `Prefill(new, cached_batch)`. A refused kind answers
INVALID_ARGUMENT naming that request and the problem; the router drops it and resends the good
ones; every other request then finishes with exactly the tokens it gets alone, and the router's
block allocator is full again. Odd but valid images (1×1, palette, alpha, CMYK, 16-bit, grayscale,
animated) are converted and succeed. The router's own checks are switched off (`HeldRouter`) and
its token counter is lenient, so what is tested is the *shard's* answer.

Call-level mistakes (duplicate ids, FilterBatch/Decode/Prefill naming wrong ids, Decode with no
batches, Warmup while batches are cached) go straight over the shard's socket while a batch is
cached; that batch must decode on to its solo tokens, and Warmup (refused while anything is cached)
must succeed at the end.

Encoder-cache entries and server-held KV blocks are not visible over gRPC: the in-process tests at
the end replay every image kind (and the text-only model's refusal) through the driver against an
engine served on a socket in this process, and check the encoder cache and the batch cache are empty
(the driver's requests carry router blocks, which its allocator accounts for); and they replay every
call-level kind, whose requests carry no blocks, checking that the shard's own KV blocks came back.
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from PIL import Image

from tests.conftest import FLOAT32_SHARD_ARGS, load_engine
from tests.e2e.driving import CONFIG, drive_router, tokens_of
from tests.server.rpc_harness import rpc_error, running_shard
from tgi_vlm.config import InputLimits
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router import (
    FinalEvent,
    RequestParams,
    Router,
    ShardClient,
    ShardProcess,
    TokenCounter,
    TokenEvent,
)
from tgi_vlm.router.tokens import CountError
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import jpeg_bytes, make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.schemas import BADGE, router_regex

ARCH = "qwen2_vl"
# Small limits keep the oversized cases cheap to build and to refuse.
LIMITS = InputLimits(max_images_per_request=2, max_image_bytes=100_000, max_image_pixels=1_000_000)
MAX_GRAMMAR_BYTES = 2048
SHARD_ENV = {
    "TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0",
    "TGI_VLM_MAX_IMAGES_PER_REQUEST": str(LIMITS.max_images_per_request),
    "TGI_VLM_MAX_IMAGE_BYTES": str(LIMITS.max_image_bytes),
    "TGI_VLM_MAX_IMAGE_PIXELS": str(LIMITS.max_image_pixels),
    "TGI_VLM_GRAMMAR_MAX_BYTES": str(MAX_GRAMMAR_BYTES),
}
VOCAB = 663  # the tiny Qwen2-VL's vocabulary


def encode(img: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 1) -> Image.Image:
    return make_test_image(width, height, seed=seed)


def corrupted(data: bytes, start: int) -> bytes:
    """The same length, with everything from `start` on zeroed (a broken data stream)."""
    return data[:start] + bytes(len(data) - start)


PNG = png_bytes(noise(40, 40))
JPEG = jpeg_bytes(noise(40, 40))

# Two requests decode while the odd one joins; two good ones join with it.
RUNNING = [
    RequestParams([png_bytes(noise(48, 48, 11)), "keep describing"], max_new_tokens=12, ignore_eos=True),
    RequestParams(["plain words that keep running"], max_new_tokens=12, ignore_eos=True, do_sample=True, seed=5,
                  temperature=0.7),
]
GOOD = [
    RequestParams([png_bytes(noise(40, 56, 12)), "what is this?"], max_new_tokens=5, ignore_eos=True),
    RequestParams(["and a text one"], max_new_tokens=5, ignore_eos=True, do_sample=True, seed=9, top_k=20),
]


def fewer_slots(request: pb.Request) -> None:
    del request.slots[len(request.slots) // 2:]


def with_grammar(grammar: str, kind: int) -> Callable[[pb.Request], None]:
    def tamper(request: pb.Request) -> None:
        request.parameters.grammar = grammar
        request.parameters.grammar_type = kind

    return tamper


@dataclass(frozen=True)
class Bad:
    """One refused kind: its prompt, parameter overrides, and the words the shard's message must contain."""

    chunks: tuple
    reason: str
    params: dict = field(default_factory=dict)
    tamper: Callable[[pb.Request], None] | None = None  # what RequestParams cannot say, done to the wire request

    def request(self) -> RequestParams:
        return RequestParams(list(self.chunks), **{"max_new_tokens": 4, "ignore_eos": True, **self.params})


def image(data: bytes) -> tuple:
    return ("see ", data, " here")


TEXT = ("fine words",)
REFUSED = {
    "png_truncated": Bad(image(PNG[:60]), "image 0: corrupt or truncated image"),
    "png_corrupt": Bad(image(corrupted(PNG, 100)), "image 0: corrupt or truncated image"),
    "jpeg_truncated": Bad(image(JPEG[: len(JPEG) // 2]), "image 0: corrupt or truncated image"),
    "jpeg_corrupt": Bad(image(corrupted(JPEG, 300)), "image 0: corrupt or truncated image"),
    "zero_bytes": Bad(image(b""), "image 0: image is empty (0 bytes)"),
    "not_an_image": Bad(image(b"hello, I am text pretending to be an image"), "image 0: cannot decode image"),
    # 3000×3000 = 9 Mpx of one gray level: 9 kB of PNG, 9 MB decoded; refused from the header.
    "decompression_bomb": Bad(image(encode(Image.new("L", (3000, 3000)), "PNG", optimize=True)),
                              f"over the limit of {LIMITS.max_image_pixels} pixels"),
    "aspect_ratio_1x4000": Bad(image(png_bytes(noise(1, 4000))), "absolute aspect ratio must be smaller than 200"),
    "too_many_images": Bad(("a ", PNG, " b ", PNG, " c ", PNG), f"more than {LIMITS.max_images_per_request} images"),
    "image_over_byte_limit": Bad(image(png_bytes(noise(200, 200))), f"over the limit of {LIMITS.max_image_bytes}"),
    "truncate_cuts_image": Bad(("a long preamble before the picture ", PNG, " and after"), "would cut image 0",
                               {"truncate": 8}),
    "empty_input": Bad(("",), "empty input"),
    "temperature_nan": Bad(TEXT, "temperature must be a finite number", {"temperature": float("nan")}),
    "temperature_negative": Bad(TEXT, "temperature must be >= 0", {"temperature": -1.0}),
    "top_p_above_1": Bad(TEXT, "top_p must be in (0, 1]", {"top_p": 1.5}),
    "typical_p_negative": Bad(TEXT, "typical_p must be in (0, 1]", {"typical_p": -0.1}),
    "repetition_penalty_negative": Bad(TEXT, "repetition_penalty must be > 0", {"repetition_penalty": -1.0}),
    "top_k_above_vocabulary": Bad(TEXT, f"top_k must be at most the vocabulary size ({VOCAB})", {"top_k": VOCAB + 1}),
    "max_new_tokens_over_max_total": Bad(TEXT, f"exceed max_total_tokens {CONFIG.max_total_tokens}",
                                         {"max_new_tokens": CONFIG.max_total_tokens}),
    "fewer_slots_than_tokens": Bad(TEXT, "KV slots", tamper=fewer_slots),
    "grammar_invalid_regex": Bad(TEXT, "invalid REGEX grammar", tamper=with_grammar("(a|b", pb.GRAMMAR_TYPE_REGEX)),
    "grammar_schema_not_handled": Bad(TEXT, "invalid JSON grammar",
                                      tamper=with_grammar('{"type": "string", "format": "shoe-size"}',
                                                          pb.GRAMMAR_TYPE_JSON)),
    "grammar_over_size_limit": Bad(TEXT, f"over the limit of {MAX_GRAMMAR_BYTES} (TGI_VLM_GRAMMAR_MAX_BYTES)",
                                   tamper=with_grammar("a" * (MAX_GRAMMAR_BYTES + 1), pb.GRAMMAR_TYPE_REGEX)),
}

# Odd but valid images: converted to RGB, never refused.
ACCEPTED = {
    "1x1": png_bytes(noise(1, 1)),
    "palette": encode(noise(30, 30, 3).convert("P"), "PNG"),
    "alpha": encode(noise(30, 30, 3).convert("RGBA"), "PNG"),
    "cmyk_jpeg": encode(noise(30, 30, 3).convert("CMYK"), "JPEG"),
    "16_bit": encode(Image.new("I;16", (30, 30), 40_000), "PNG"),
    "grayscale": encode(noise(30, 30, 3).convert("L"), "PNG"),
    "animated_gif": encode(noise(30, 30, 3), "GIF", save_all=True, append_images=[noise(30, 30, 4)], duration=50),
    "animated_png": encode(noise(30, 30, 3), "PNG", save_all=True, append_images=[noise(30, 30, 4)], duration=50),
}


# ----- the driver, wired so the odd request joins a decoding batch together with good ones -----

class HeldRouter(Router):
    """The router driver with its own request checks off (the shard's are under test) and a switch
    that keeps new requests queued while a batch runs, so joiners arrive in one Prefill."""

    hold = False

    def _validate(self, entry):
        return None

    def _next_batch(self, cached, waiting_steps=0):
        if cached is not None and self.hold:
            return None
        return super()._next_batch(cached, waiting_steps)


class WireClient:
    """ShardClient that records Prefills and refusals, can hold Decode, and can tamper with one request."""

    def __init__(self, client: ShardClient):
        self.client = client
        self.gate = asyncio.Event()
        self.gate.set()
        self.prefills: list[tuple[list[int], bool]] = []  # (request ids, with a cached batch)
        self.refusals: list[tuple[grpc.StatusCode, str]] = []
        self.tamper: tuple[int, Callable[[pb.Request], None]] | None = None

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def prefill(self, batch, cached_batch=None):
        for request in batch.requests:
            if self.tamper and request.id == self.tamper[0]:
                self.tamper[1](request)
        self.prefills.append(([r.id for r in batch.requests], cached_batch is not None))
        try:
            return await self.client.prefill(batch, cached_batch)
        except grpc.aio.AioRpcError as exc:
            self.refusals.append((exc.code(), exc.details()))
            raise

    async def decode(self, batches):
        await self.gate.wait()
        return await self.client.decode(batches)


def lenient(counter: TokenCounter) -> Callable[[pb.Request], int]:
    """Count as the router would, but let requests it cannot count reach the shard."""

    def count(request: pb.Request) -> int:
        try:
            return counter.count(request)
        except CountError:
            return 16

    return count


def drive(socket: str, count_tokens, scenario, timeout: float = 120.0):
    """Run `scenario(router, client)` with a fresh held router; the router's allocator must be full again after."""
    return drive_router(socket, count_tokens, scenario, client=WireClient, router=HeldRouter, timeout=timeout)


@dataclass
class Joined:
    running: list[tuple[list[int], FinalEvent]]
    good: list[tuple[list[int], FinalEvent]]
    odd: list[tuple[list[int], FinalEvent]]
    odd_ids: list[int]
    good_ids: list[int]
    prefills: list[tuple[list[int], bool]]
    refusals: list[tuple[grpc.StatusCode, str]]


async def join_decoding_batch(router: HeldRouter, client: WireClient, odd: list[RequestParams],
                              tamper: Callable[[pb.Request], None] | None = None,
                              running: list[RequestParams] = RUNNING, good: list[RequestParams] = GOOD) -> Joined:
    """`running` decode; then good[0], *odd, good[1] join them in one Prefill(new, cached)."""
    streams = [await router.submit(p) for p in running]
    firsts = [await s.entry.events.get() for s in streams]  # each has its first token: the batch is decoding
    assert all(isinstance(e, TokenEvent) for e in firsts), firsts
    client.gate.clear()
    router.hold = True
    joiners = [await router.submit(p) for p in (good[0], *odd, good[1])]
    if tamper is not None:
        client.tamper = (joiners[1].request_id, tamper)
    client.prefills.clear()
    router.hold = False
    client.gate.set()
    outputs = [await tokens_of(s) for s in (*streams, *joiners)]
    for (ids, _), first in zip(outputs, firsts):
        ids.insert(0, first.token_id)
    n = len(running)
    return Joined(outputs[:n], [outputs[n], outputs[-1]], outputs[n + 1:-1], [s.request_id for s in joiners[1:-1]],
                  [joiners[0].request_id, joiners[-1].request_id], client.prefills, client.refusals)


async def alone(router: Router, params: RequestParams) -> list[int]:
    ids, final = await tokens_of(await router.submit(params))
    assert final.ok, final.error
    return ids


def named_requests(details: str) -> set[int]:
    return {int(m) for m in re.findall(r"request (\d+):", details)}


def assert_others_as_alone(joined: Joined, solo: dict[str, list[int]]) -> None:
    for i, (ids, final) in enumerate(joined.running):
        assert final.ok and ids == solo[f"running{i}"], f"running request {i}: {final.error}"
    for i, (ids, final) in enumerate(joined.good):
        assert final.ok and ids == solo[f"good{i}"], f"good request {i}: {final.error}"


# ----- fixtures -----

@pytest.fixture(scope="module")
def shard():
    with ShardProcess(str(tiny_model_path(ARCH)), env=SHARD_ENV, extra_args=FLOAT32_SHARD_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def count_tokens():
    return lenient(TokenCounter(str(tiny_model_path(ARCH)), limits=LIMITS))


@pytest.fixture(scope="module")
def solo(shard, count_tokens) -> dict[str, list[int]]:
    """The tokens each running and good request gets alone on this shard."""

    async def scenario(router, client):
        named = {f"running{i}": p for i, p in enumerate(RUNNING)} | {f"good{i}": p for i, p in enumerate(GOOD)}
        return {name: await alone(router, p) for name, p in named.items()}

    return drive(shard.socket, count_tokens, scenario)


# ----- request-level kinds through the driver -----

@pytest.mark.parametrize("kind", list(REFUSED))
def test_a_refused_request_fails_alone_while_the_others_finish_as_if_alone(shard, count_tokens, solo, kind):
    bad = REFUSED[kind]

    async def scenario(router, client):
        return await join_decoding_batch(router, client, [bad.request()], bad.tamper)

    joined = drive(shard.socket, count_tokens, scenario)
    (bad_id,), (g0, g1) = joined.odd_ids, joined.good_ids
    assert len(joined.refusals) == 1, joined.refusals
    code, details = joined.refusals[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert named_requests(details) == {bad_id} and bad.reason in details, details
    assert joined.prefills[:2] == [([g0, bad_id, g1], True), ([g0, g1], True)]  # refused, then the good ones resent
    final = joined.odd[0][1]
    assert not final.ok and bad.reason in final.error
    assert_others_as_alone(joined, solo)


@pytest.mark.parametrize("kind", list(ACCEPTED))
def test_an_odd_but_valid_image_is_converted_and_served(shard, count_tokens, solo, kind):
    odd = RequestParams(["see ", ACCEPTED[kind], " here"], max_new_tokens=4, ignore_eos=True)

    async def scenario(router, client):
        return await join_decoding_batch(router, client, [odd])

    joined = drive(shard.socket, count_tokens, scenario)
    assert joined.refusals == []
    assert joined.prefills[0] == ([joined.good_ids[0], *joined.odd_ids, joined.good_ids[1]], True)
    ids, final = joined.odd[0]
    assert final.ok and len(ids) == final.generated_tokens == 4, final.error
    assert_others_as_alone(joined, solo)


def test_a_router_shaped_grammar_request_joins_and_its_output_matches(shard, count_tokens, solo):
    """What TGI's router sends for a `json` grammar: the schema compiled to a regex, ignore_eos false."""
    regex = router_regex(BADGE)
    odd = RequestParams(["answer as json"], max_new_tokens=120, grammar=regex, grammar_type=pb.GRAMMAR_TYPE_REGEX)

    async def scenario(router, client):
        return await join_decoding_batch(router, client, [odd])

    joined = drive(shard.socket, count_tokens, scenario)
    assert joined.refusals == []
    ids, final = joined.odd[0]
    assert final.ok and final.finish_reason == "eos_token", final
    assert re.fullmatch(regex, final.text), final.text
    assert_others_as_alone(joined, solo)


# ----- call-level mistakes straight over the socket -----

def good_batch(batch_id: int, first_id: int) -> pb.Batch:
    requests = [p.to_pb(first_id + i) for i, p in enumerate(GOOD)]  # no blocks: the shard allocates
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


def duplicate_ids(client: ShardClient, cached: pb.CachedBatch):
    batch = good_batch(2, 50)
    batch.requests[1].id = 50
    return client.prefill(batch, cached)


# kind → (call made while batch 1 is cached, status, words in the message)
CALLS: dict[str, tuple[Callable[[ShardClient, pb.CachedBatch], Awaitable], grpc.StatusCode, str]] = {
    "duplicate_request_ids": (duplicate_ids, grpc.StatusCode.INVALID_ARGUMENT, "request 50: duplicate request id"),
    "filter_with_ids_not_in_batch": (lambda c, b: c.filter_batch(b.id, [b.request_ids[0], 999]),
                                     grpc.StatusCode.INVALID_ARGUMENT, "[999] are not in batch 1"),
    "filter_keeping_nothing": (lambda c, b: c.filter_batch(b.id, []), grpc.StatusCode.INVALID_ARGUMENT,
                               "keeps no request"),
    "decode_with_no_batches": (lambda c, b: c.decode([]), grpc.StatusCode.INVALID_ARGUMENT, "no batches"),
    "decode_listing_a_batch_twice": (lambda c, b: c.decode([b, b]), grpc.StatusCode.INVALID_ARGUMENT,
                                     "listed more than once"),
    "empty_batch": (lambda c, b: c.prefill(pb.Batch(id=2), b), grpc.StatusCode.INVALID_ARGUMENT, "has no requests"),
    "decode_unknown_batch": (lambda c, b: c.decode([b, pb.CachedBatch(id=77)]), grpc.StatusCode.NOT_FOUND,
                             "batch 77 not found"),
    "filter_unknown_batch": (lambda c, b: c.filter_batch(77, [1]), grpc.StatusCode.NOT_FOUND, "batch 77 not found"),
    "prefill_with_unknown_cached_batch": (lambda c, b: c.prefill(good_batch(2, 60), pb.CachedBatch(id=77)),
                                          grpc.StatusCode.NOT_FOUND, "batch 77 not found"),
    "warmup_while_a_batch_is_cached": (lambda c, b: c.warmup(warmup_request(200, 256, 300)),
                                       grpc.StatusCode.INVALID_ARGUMENT, "send ClearCache first"),
}


def generated(response) -> dict[int, list[int]]:
    return {g.request_id: list(g.tokens.ids) for g in response.generations}


async def decode_to_end(client: ShardClient, response, tokens: dict[int, list[int]]) -> None:
    while response.HasField("batch"):
        response = await client.decode([response.batch])
        for rid, ids in generated(response).items():
            tokens.setdefault(rid, []).extend(ids)


async def wrong_call_while_a_batch_decodes(client: ShardClient, kind: str) -> dict[int, list[int]]:
    """Batch 1 (RUNNING[0], request 1) is cached; the wrong call is refused; the good requests 10 and 11
    join batch 1 and everything decodes to the end. No request carries blocks: the shard allocates."""
    call, code, words = CALLS[kind]
    first = await client.prefill(pb.Batch(id=1, requests=[RUNNING[0].to_pb(1)], size=1))
    tokens = generated(first)
    error = await rpc_error(call(client, first.batch))
    assert error.code() == code and words in error.details(), error.details()
    response = await client.prefill(good_batch(2, 10), first.batch)  # good requests join the batch
    for rid, ids in generated(response).items():
        tokens.setdefault(rid, []).extend(ids)
    await decode_to_end(client, response, tokens)
    return tokens


@pytest.mark.parametrize("kind", list(CALLS))
def test_a_wrong_call_is_refused_and_the_cached_batch_decodes_on(shard, solo, kind):
    async def scenario():
        client = ShardClient(shard.socket)
        try:
            await client.clear_cache(None)
            await client.warmup(warmup_request(200, 256, 300))  # Warmup with nothing cached: OK
            tokens = await wrong_call_while_a_batch_decodes(client, kind)
            await client.warmup(warmup_request(200, 256, 300))  # refused while anything is cached: nothing is
            return tokens
        finally:
            await client.close()

    tokens = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert tokens == {1: solo["running0"], 10: solo["good0"], 11: solo["good1"]}


# ----- in-process variants: what gRPC cannot show (encoder cache, server-held blocks) -----

def in_process(engine, count_tokens, scenario):
    async def main():
        async with running_shard(engine) as served:
            result = await asyncio.wait_for(
                asyncio.to_thread(drive, served.config.socket_path(), count_tokens, scenario), 240)
            assert len(served.service.cache) == 0
            return result

    return asyncio.run(main())


def test_in_process_every_image_kind_at_once_leaves_no_encoder_entries_or_batches():
    engine = load_engine(ARCH, limits=LIMITS)
    count_tokens = lenient(TokenCounter(str(tiny_model_path(ARCH)), limits=LIMITS))
    refused = {k: b for k, b in REFUSED.items() if any(isinstance(c, bytes) for c in b.chunks)}
    odd = [b.request() for b in refused.values()] + [
        RequestParams(["see ", data, " here"], max_new_tokens=4, ignore_eos=True) for data in ACCEPTED.values()]

    async def scenario(router, client):
        solo = {f"running{i}": await alone(router, p) for i, p in enumerate(RUNNING)}
        solo |= {f"good{i}": await alone(router, p) for i, p in enumerate(GOOD)}
        return solo, await join_decoding_batch(router, client, odd)

    solo, joined = in_process(engine, count_tokens, scenario)
    refused_ids = set(joined.odd_ids[: len(refused)])
    assert len(joined.refusals) == 1 and named_requests(joined.refusals[0][1]) == refused_ids
    assert [final.ok for _, final in joined.odd] == [False] * len(refused) + [True] * len(ACCEPTED)
    assert_others_as_alone(joined, solo)
    assert engine.encoder_cache.num_entries == 0  # KV blocks were the router's: its allocator is full again


def test_in_process_text_only_model_refuses_an_image_and_the_others_finish_as_if_alone():
    engine = load_engine("llama")
    count_tokens = lenient(TokenCounter(str(tiny_model_path("llama"))))
    running = [RequestParams(["the running one"], max_new_tokens=12, ignore_eos=True),
               RequestParams(["another running", " one"], max_new_tokens=12, ignore_eos=True, do_sample=True, seed=2)]
    good = [RequestParams(["good words"], max_new_tokens=5, ignore_eos=True),
            RequestParams(["more good words"], max_new_tokens=5, ignore_eos=True, top_p=0.9, seed=4)]
    bad = RequestParams(["look at ", PNG], max_new_tokens=4, ignore_eos=True)

    async def scenario(router, client):
        solo = {f"running{i}": await alone(router, p) for i, p in enumerate(running)}
        solo |= {f"good{i}": await alone(router, p) for i, p in enumerate(good)}
        return solo, await join_decoding_batch(router, client, [bad], running=running, good=good)

    solo, joined = in_process(engine, count_tokens, scenario)
    (code, details), = joined.refusals
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert named_requests(details) == set(joined.odd_ids) and "text-only and cannot take image inputs" in details
    assert not joined.odd[0][1].ok
    assert_others_as_alone(joined, solo)


def test_in_process_every_wrong_call_leaves_no_server_blocks_encoder_entries_or_batches(solo):
    """The call-level kinds again, in process: their requests carry no blocks, so the KV blocks are
    the shard's own and must all be back after each scenario."""
    engine = load_engine(ARCH, limits=LIMITS)

    async def main():
        async with running_shard(engine) as served:
            client = ShardClient(served.config.socket_path())
            try:
                await client.warmup(warmup_request(200, 256, 300))
                for kind in CALLS:
                    tokens = await wrong_call_while_a_batch_decodes(client, kind)
                    assert tokens == {1: solo["running0"], 10: solo["good0"], 11: solo["good1"]}, kind
                    leftovers = (engine.kv_blocks_in_use, engine.encoder_cache.num_entries, served.service.cache.ids())
                    assert leftovers == (0, 0, []), kind
            finally:
                await client.close()

    asyncio.run(asyncio.wait_for(main(), 240))
