"""Prefix caching end to end: a real shard process (tiny Qwen2-VL) driven by the router driver with
its image-aware prefix cache. Every hit is checked on the wire (the cache_len and blocks the driver
sent) and every output against transformers' greedy tokens for that prompt alone.

The shard runs with PREFIX_CACHING=0 (Info says use_prefix_caching=false, as for any VLM): the
driver does not need TGI's permission, because the shard verifies each claim.
"""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.e2e.driving import CONFIG, drive_router, tokens_of
from tests.models.prefix_routing import common_blocks
from tests.models.vlm_reference import hf_reference
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router import RequestParams, RouterConfig, ShardClient, ShardProcess, TokenCounter
from tgi_vlm.router.prefix_cache import prompt_blocks
from tgi_vlm.router.requests import build_request
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path

ARCH = "qwen2_vl"
BS = 16  # the shard's BLOCK_SIZE
SHARD_ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0",
             "BLOCK_SIZE": str(BS)}
SYSTEM = ("You are a careful assistant. You describe pictures in plain words, you answer briefly, "
          "and you never make up details that are not in the picture. ")


def image(width: int, height: int, seed: int) -> bytes:
    return png_bytes(make_test_image(width, height, seed=seed))


class RecordingClient:
    """ShardClient that keeps a copy of every request sent in a Prefill, the refusals, and can hold Decode."""

    def __init__(self, client: ShardClient):
        import asyncio

        self.client = client
        self.sent: list[tuple[pb.Request, bool]] = []  # (request, joined a cached batch)
        self.refusals: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def prefill(self, batch, cached_batch=None):
        for r in batch.requests:
            copy = pb.Request()
            copy.CopyFrom(r)
            self.sent.append((copy, cached_batch is not None))
        try:
            return await self.client.prefill(batch, cached_batch)
        except grpc.aio.AioRpcError as exc:
            self.refusals.append(exc.details())
            raise

    async def decode(self, batches):
        await self.gate.wait()
        return await self.client.decode(batches)

    def requests(self, request_id: int) -> list[pb.Request]:
        """Every Prefill that carried this request, in order (more than one after a refused claim)."""
        return [r for r, _ in self.sent if r.id == request_id]


@pytest.fixture(scope="module")
def shard():
    with ShardProcess(str(tiny_model_path(ARCH)), env=SHARD_ENV, extra_args=FLOAT32_SHARD_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(str(tiny_model_path(ARCH)))


def drive(shard, counter, scenario, config: RouterConfig = CONFIG):
    assert config.prefix_caching  # the default
    return drive_router(shard.socket, counter.tokenize, scenario, client=RecordingClient, timeout=120, config=config)


def prompt_ids(counter: TokenCounter, chunks) -> list[int]:
    return counter.tokenize(build_request(0, chunks)).ids


def keyed(counter: TokenCounter, params: RequestParams, router):
    prompt = counter.tokenize(build_request(0, params.chunks))
    return prompt_blocks(prompt.ids, prompt.media, prompt.group_ids, router.allocator.block_size)


def transformers_tokens(params: RequestParams) -> list[int]:
    return hf_reference(ARCH, tuple(params.chunks), params.max_new_tokens).ids


async def run(router, params: RequestParams) -> tuple[int, list[int]]:
    stream = await router.submit(params)
    ids, final = await tokens_of(stream)
    assert final.ok, final.error
    return stream.request_id, ids


# ----- multi-turn chat: the conversation is resent every turn with the same image -----

QUESTIONS = ["What is in the picture? ", "And what colors do you see? ", "Is it day or night there? ",
             "Summarize it in one line. "]


def test_a_multi_turn_chat_hits_from_turn_two_and_every_turn_gives_transformers_tokens(shard, counter):
    picture = image(112, 112, 1)

    async def scenario(router, client):
        history: list[str | bytes] = [SYSTEM, picture]
        turns = []
        for question in QUESTIONS:
            history.append(question)
            params = RequestParams(list(history), max_new_tokens=6, ignore_eos=True)
            stream = await router.submit(params)
            ids, final = await tokens_of(stream)
            assert final.ok, final.error
            turns.append((params, stream.request_id, ids))
            history.append(final.text + " ")  # the assistant's answer joins the conversation
        return turns, client, router.prefix_stats

    turns, client, stats = drive(shard, counter, scenario)
    prompts = [prompt_ids(counter, params.chunks) for params, _, _ in turns]
    sent = [client.requests(rid)[0].cache_len for _, rid, _ in turns]
    expected = [0] + [max(common_blocks(p, prompts[t], BS) for p in prompts[:t]) * BS for t in range(1, len(turns))]
    assert sent == expected and all(n >= 3 * BS for n in sent[1:]), (sent, expected)
    assert (stats.requests, stats.hits, stats.refused_claims) == (4, 3, 0)
    assert (stats.cached_tokens, stats.prompt_tokens) == (sum(expected), sum(map(len, prompts)))
    for params, _, ids in turns:
        assert ids == transformers_tokens(params)


# ----- the trap: same text, different image -----

def test_the_same_text_with_another_image_is_not_offered_the_first_images_blocks(shard, counter):
    first = RequestParams([SYSTEM, image(112, 112, 1), "What is this?"], max_new_tokens=6, ignore_eos=True)
    other = RequestParams([SYSTEM, image(112, 112, 2), "What is this?"], max_new_tokens=6, ignore_eos=True)
    a = counter.tokenize(build_request(0, first.chunks))
    b = counter.tokenize(build_request(0, other.chunks))
    assert a.ids == b.ids and a.media[0].digest != b.media[0].digest  # token ids alone cannot tell them apart
    offset = b.media[0].offset

    async def scenario(router, client):
        _, first_ids = await run(router, first)
        rid, other_ids = await run(router, other)
        return first_ids, other_ids, client.requests(rid)

    first_ids, other_ids, sent = drive(shard, counter, scenario)
    assert [r.cache_len for r in sent] == [offset - offset % BS]  # stops before the image's first block
    assert 0 < sent[0].cache_len < offset
    assert first_ids == transformers_tokens(first)
    assert other_ids == transformers_tokens(other)


# ----- a shared text system prompt across concurrent requests -----

def test_concurrent_requests_share_the_system_prompts_blocks_and_get_transformers_tokens(shard, counter):
    owner = RequestParams([SYSTEM + "Hello there."], max_new_tokens=12, ignore_eos=True)
    joiners = [RequestParams([SYSTEM + q], max_new_tokens=5, ignore_eos=True)
               for q in ("Name three birds.", "Count to five.", "Why is grass green?")]
    joiners.append(RequestParams([SYSTEM, image(56, 56, 3), "Describe it."], max_new_tokens=5, ignore_eos=True))

    async def scenario(router, client):
        stream = await router.submit(owner)
        await stream.entry.events.get()  # its first token: prefilled, its prompt blocks are cached
        client.gate.clear()  # hold Decode so that the joiners queue up and join in one Prefill
        streams = [await router.submit(p) for p in joiners]
        client.gate.set()
        outputs = [await tokens_of(s) for s in streams]
        await tokens_of(stream)
        return [s.request_id for s in streams], outputs, stream.request_id, client

    ids, outputs, owner_id, client = drive(shard, counter, scenario)
    owner_prompt = prompt_ids(counter, owner.chunks)
    owner_blocks = list(client.requests(owner_id)[0].blocks)
    joined = [r for r, with_cached in client.sent if r.id in ids and with_cached]
    assert [r.id for r in joined] == ids  # all four in one Prefill(new, cached batch)
    for r, params in zip(joined, joiners):
        k = common_blocks(owner_prompt, prompt_ids(counter, params.chunks), BS)
        assert k >= 3 and r.cache_len == k * BS
        assert list(r.blocks[:k]) == owner_blocks[:k]  # the same physical blocks, not copies
    for params, (tokens, final) in zip(joiners, outputs):
        assert final.ok and tokens == transformers_tokens(params)


# ----- eviction under memory pressure -----

def story(k: int) -> RequestParams:
    text = f"Story {k}: a small boat crossed the quiet bay"
    return RequestParams([f"Note {k}. ", image(56, 56, 10 + k), text], max_new_tokens=8, ignore_eos=True)


def test_eviction_under_memory_pressure_drops_least_recently_used_blocks_and_tokens_stay_exact(shard, counter):
    stories = [story(k) for k in range(1, 6)]
    for params in stories:  # two whole prompt blocks each; with 8 new tokens, three blocks a request
        assert 2 * BS < len(prompt_ids(counter, params.chunks)) <= 3 * BS - 7
    # 10 blocks: stories 1-4 leave 8 cached; story 5 evicts story 1's first block; story 4 again hits
    # (32 tokens); story 1 again misses (its chain starts at the evicted block) and evicts the two
    # least recently used: story 1's second block and story 2's first.
    config = RouterConfig(max_input_tokens=200, max_total_tokens=300, max_batch_prefill_tokens=256,
                          max_batch_total_tokens=11 * BS)

    async def scenario(router, client):
        runs = [await run(router, p) for p in (*stories, stories[3], stories[0])]
        left = [router.allocator.cache_len(keyed(counter, p, router)) for p in stories]
        return runs, client, router.prefix_stats, left

    runs, client, stats, left = drive(shard, counter, scenario, config)
    sent = [client.requests(rid)[0].cache_len for rid, _ in runs]
    assert sent == [0, 0, 0, 0, 0, 2 * BS, 0]
    assert stats.evictions == 3
    assert left == [2 * BS, 0, 2 * BS, 2 * BS, 2 * BS]  # what a new request for each story would find now
    for params, (_, ids) in zip((*stories, stories[3], stories[0]), runs):
        assert ids == transformers_tokens(params)


# ----- a claim the shard refuses -----

def test_a_forged_claim_is_refused_by_the_shard_and_the_request_completes_via_a_cache_len_0_resend(shard, counter):
    owner = RequestParams([SYSTEM + "Tell me about the sea."], max_new_tokens=4, ignore_eos=True)
    victim = RequestParams(["Completely different words here, about mountains and the snow on them, "
                            "and the long winter. ", image(56, 56, 4), "Why?"], max_new_tokens=6, ignore_eos=True)
    victim_len = len(prompt_ids(counter, victim.chunks))
    assert victim_len > 2 * BS and victim_len != len(prompt_ids(counter, owner.chunks))

    async def scenario(router, client):
        owner_id, _ = await run(router, owner)
        owner_blocks = list(client.requests(owner_id)[0].blocks[:2])
        cache = router.allocator
        real = cache._match

        def forged(prompt):  # the driver offers the owner's blocks for the victim's first 32 tokens
            if prompt is not None and prompt.length == victim_len:
                return owner_blocks, 2 * BS
            return real(prompt)

        cache._match = forged
        rid, ids = await run(router, victim)
        cache._match = real
        owner_left = cache.cache_len(keyed(counter, owner, router))
        return owner_blocks, rid, ids, client, router.prefix_stats, owner_left

    owner_blocks, rid, ids, client, stats, owner_left = drive(shard, counter, scenario)
    forged_request, resent = client.requests(rid)
    assert forged_request.cache_len == 2 * BS and list(forged_request.blocks[:2]) == owner_blocks
    assert len(client.refusals) == 1
    assert f"request {rid}: cache_len={2 * BS} claims block {owner_blocks[0]}" in client.refusals[0]
    assert resent.cache_len == 0
    assert owner_left == 0  # the blocks of the refused claim left the driver's cache
    assert stats.refused_claims == 1 and stats.hits == 0
    assert ids == transformers_tokens(victim)


# ----- prefill logprobs: no lookup, no insert -----

def test_a_request_with_prefill_logprobs_is_neither_looked_up_nor_cached(shard, counter):
    question = "Second question: please list many things about the weather, the sea and the hills"
    plain = RequestParams([SYSTEM + "First question."], max_new_tokens=4, ignore_eos=True)
    with_logprobs = RequestParams([SYSTEM + question + "?"], max_new_tokens=4, ignore_eos=True, prefill_logprobs=True)
    again = RequestParams([SYSTEM + question + " today?"], max_new_tokens=4, ignore_eos=True)
    plain_ids, logprobs_ids, again_ids = (prompt_ids(counter, p.chunks) for p in (plain, with_logprobs, again))
    k = common_blocks(plain_ids, again_ids, BS)
    assert common_blocks(logprobs_ids, again_ids, BS) > k  # had it been cached, `again` would find more

    async def scenario(router, client):
        await run(router, plain)
        inserted = router.prefix_stats.inserted
        rid, ids = await run(router, with_logprobs)
        assert router.prefix_stats.inserted == inserted
        again_id, _ = await run(router, again)
        return client.requests(rid)[0].cache_len, ids, client.requests(again_id)[0].cache_len

    logprobs_cache_len, ids, again_cache_len = drive(shard, counter, scenario)
    assert logprobs_cache_len == 0
    assert again_cache_len == k * BS  # the system prompt's blocks (from `plain`) only
    assert ids == transformers_tokens(with_logprobs)
