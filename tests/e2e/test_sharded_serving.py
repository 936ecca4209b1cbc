"""Two ranks of `serve --sharded` (tiny Qwen2-VL, float32), started as TGI's launcher starts them, driven
through the sharded client as TGI's router drives them; one unsharded shard beside them for comparison.

Until the model is split across ranks each rank computes everything; what is checked here is the
wire: the rank that answers each request, merged steps, identical batches and refusals on every
rank, the same tokens as one shard, and how the ranks end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from tests.e2e.driving import tokens_of
from tgi_vlm import cli
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router import RequestParams, Router, RouterConfig, ShardClient, TokenCounter
from tgi_vlm.router.shard import free_port, server_command
from tgi_vlm.router.sharded_client import ShardedClient, connect
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import make_request

ARCH = "qwen2_vl"
SHARD_ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0",
             "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parents[2] / "src"),
                                                       os.environ.get("PYTHONPATH")) if p)}
# Small prefill budget: the long prompt below is prefilled in chunks, so some steps carry a request
# that is still prefilling.
CONFIG = RouterConfig(max_input_tokens=200, max_total_tokens=300, max_batch_prefill_tokens=64, prefix_caching=False)
EXIT_BOUND_S = 60  # far above what a clean exit takes; only a hang reaches it


def image(width: int, height: int, seed: int) -> bytes:
    return png_bytes(make_test_image(width, height, seed=seed))


REQUESTS = [
    RequestParams([image(56, 56, 1), "what is in the picture?"], max_new_tokens=6, ignore_eos=True),
    RequestParams(["a long story: " + "and then the hills and the sea " * 12], max_new_tokens=5, ignore_eos=True),
    RequestParams(["no image, sampled"], max_new_tokens=5, ignore_eos=True, do_sample=True, seed=7, temperature=0.8),
    RequestParams(["compare ", image(40, 72, 2), " with the sky"], max_new_tokens=4, ignore_eos=True),
]


class Shards:
    """`serve` processes on one uds base: rank r binds {base}-r (argv and environment as the launcher's)."""

    def __init__(self, world_size: int):
        self.directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")
        self.base = f"{self.directory}/s"
        self.logs = [Path(self.directory) / f"rank{rank}.log" for rank in range(world_size)]
        self.args = [server_command(), "serve", str(tiny_model_path(ARCH)), "--uds-path", self.base,
                     "--logger-level", "INFO", "--json-output", *(["--sharded"] if world_size > 1 else []),
                     "--dtype", "float32"]
        launcher = {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port())}
        self.processes = []
        for rank in range(world_size):
            with open(self.logs[rank], "w") as log:
                self.processes.append(subprocess.Popen(self.args, env={**os.environ, **SHARD_ENV, **launcher,
                                                                       "RANK": str(rank)},
                                                       stdout=log, stderr=subprocess.STDOUT))

    def socket(self, rank: int) -> str:
        return f"{self.base}-{rank}"

    def wait_until_bound(self) -> None:
        deadline = time.monotonic() + 180
        while not all(os.path.exists(self.socket(rank)) for rank in range(len(self.processes))):
            assert all(p.poll() is None for p in self.processes), self.log_text()
            assert time.monotonic() < deadline, "the shard did not bind its sockets"
            time.sleep(0.05)

    def log_text(self) -> str:
        return "\n".join(f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(self.logs))

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(EXIT_BOUND_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def shards():
    """(the two-rank shard, a one-rank shard), started together."""
    started = [Shards(2), Shards(1)]
    try:
        for group in started:
            group.wait_until_bound()
        yield started
    finally:
        for group in started:
            group.close()


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(str(tiny_model_path(ARCH)))


class Recorder:
    """A client (one rank's, or the merged one) that keeps every Prefill/Decode answer or error."""

    def __init__(self, client):
        self.client = client
        self.steps: list[tuple[str, object]] = []

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def _record(self, kind: str, call):
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            self.steps.append((kind, exc))
            raise
        self.steps.append((kind, response))
        return response

    async def prefill(self, batch, cached_batch=None):
        return await self._record("prefill", self.client.prefill(batch, cached_batch))

    async def decode(self, batches):
        return await self._record("decode", self.client.decode(batches))


async def recorded_ranks(socket: str) -> tuple[ShardedClient, list[Recorder]]:
    """ServiceDiscovery on rank 0, then one recorded client per rank under TGI's merge rules."""
    master = ShardClient(socket)
    urls = await master.service_discovery()
    await master.close()
    ranks = [Recorder(ShardClient(url)) for url in urls]
    return ShardedClient(ranks), ranks


async def run_requests(client, counter: TokenCounter, requests: list[RequestParams]) -> list[tuple[list[int], object]]:
    """All requests at once through a fresh router (ClearCache, Info, Warmup first, as TGI's)."""
    router = Router(client, counter.count, CONFIG)
    await router.start()
    loop = asyncio.create_task(router.run())
    try:
        streams = [await router.submit(params) for params in requests]
        return [await tokens_of(stream) for stream in streams]
    finally:
        router.stop()
        await loop
        await client.close()


def test_rank_0_lists_both_ranks_and_each_rank_was_started_as_the_launcher_starts_it(shards):
    pair, _ = shards

    async def discover():
        client = ShardClient(pair.socket(0))
        try:
            return await client.service_discovery()
        finally:
            await client.close()

    urls = asyncio.run(discover())
    assert urls == [f"unix://{pair.base}-0", f"unix://{pair.base}-1"]
    for rank, process in enumerate(pair.processes):
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{process.pid}/environ").read_text().split("\0") if v)
        assert [environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")] == [str(rank), "2", "localhost"]
        argv = Path(f"/proc/{process.pid}/cmdline").read_text().split("\0")[:-1]
        assert argv[argv.index("serve"):] == ["serve", str(tiny_model_path(ARCH)), "--uds-path", pair.base,
                                              "--logger-level", "INFO", "--json-output", "--sharded",
                                              "--dtype", "float32"]


def test_sharded_steps_merge_to_one_generation_per_request_and_match_one_shard(shards, counter):
    pair, single = shards

    async def sharded():
        merged, ranks = await recorded_ranks(pair.socket(0))
        recorded = Recorder(merged)
        return await run_requests(recorded, counter, REQUESTS), recorded.steps, [r.steps for r in ranks]

    async def one_shard():
        return await run_requests(await connect(single.socket(0)), counter, REQUESTS)

    results, merged_steps, rank_steps = asyncio.run(sharded())
    alone = asyncio.run(one_shard())
    # The same tokens as one shard, request by request (greedy and seeded sampling alike).
    for params, (ids, final), (single_ids, _) in zip(REQUESTS, results, alone):
        assert final.ok, final.error
        assert len(ids) == params.max_new_tokens and ids == single_ids
    assert len(rank_steps[0]) == len(rank_steps[1]) == len(merged_steps)
    ids_of = [final.request_id for _, final in results]
    still_prefilling = 0
    for (kind, merged), (kind0, step0), (kind1, step1) in zip(merged_steps, *rank_steps):
        assert kind == kind0 == kind1
        # Every rank keeps the same batch; each answers for the requests it owns, and only those.
        assert step0.HasField("batch") == step1.HasField("batch")
        assert step0.batch == step1.batch == merged.batch
        assert all(g.request_id % 2 == 0 for g in step0.generations)
        assert all(g.request_id % 2 == 1 for g in step1.generations)
        generated = [g.request_id for g in merged.generations]
        assert generated == [g.request_id for g in (*step1.generations, *step0.generations)]
        assert len(generated) == len(set(generated))  # one Generation per request per step
        still_prefilling += len(set(step0.batch.request_ids) - set(generated))
    # The long prompt took several chunks, answered by no rank until its prompt was done.
    assert still_prefilling >= 2
    # Every token of every request came from exactly one Generation.
    counts = {rid: 0 for rid in ids_of}
    for _, merged in merged_steps:
        for g in merged.generations:
            counts[g.request_id] += len(g.tokens.ids)
    assert counts == {rid: params.max_new_tokens for rid, params in zip(ids_of, REQUESTS)}


def test_a_bad_request_is_refused_by_both_ranks_alike_and_the_rest_of_the_batch_goes_on(shards):
    pair, _ = shards
    undecodable = image(30, 30, 0)[:60]
    good = [make_request(1, image(48, 48, 3), "describe", max_new_tokens=3),
            make_request(4, "plain text", max_new_tokens=3)]
    bad = [make_request(2, "broken ", undecodable, " image", max_new_tokens=3),
           make_request(3, "far too long " * 120, max_new_tokens=3)]

    async def scenario():
        client, ranks = await recorded_ranks(pair.socket(0))
        try:
            await client.clear_cache(None)
            await client.warmup(warmup_request(CONFIG.max_input_tokens, CONFIG.max_batch_prefill_tokens,
                                               CONFIG.max_total_tokens))
            errors = []  # [rank 0's, rank 1's] for each bad request
            for request in bad:
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.prefill(pb.Batch(id=1, requests=[good[0], request, good[1]], size=3))
                errors.append([rank.steps[-1][1] for rank in ranks])
            response = await client.prefill(pb.Batch(id=1, requests=good, size=2))
            steps = [response]
            while response.HasField("batch"):
                response = await client.decode([response.batch])
                steps.append(response)
            return errors, steps
        finally:
            await client.close()

    errors, steps = asyncio.run(scenario())
    for (rank0, rank1), (rid, problem) in zip(errors, [(2, "corrupt or truncated image"),
                                                       (3, "exceed max_total_tokens 300")]):
        assert rank0.code() == rank1.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rank0.details() == rank1.details()
        assert f"request {rid}: " in rank0.details() and problem in rank0.details()
        assert "request 1:" not in rank0.details() and "request 4:" not in rank0.details()
    assert [[g.request_id for g in step.generations] for step in steps] == [[1, 4]] * 3
    assert [g.generated_text.generated_tokens for g in steps[-1].generations] == [3, 3]


def test_the_liveness_prefill_reaches_both_ranks_and_one_answers(shards):
    pair, _ = shards

    async def scenario():
        client, ranks = await recorded_ranks(pair.socket(0))
        try:
            await client.clear_cache(None)
            return await client.liveness(), ranks
        finally:
            await client.close()

    merged, ranks = asyncio.run(scenario())
    rank0, rank1 = (rank.steps[-1][1] for rank in ranks)
    assert [g.request_id for g in rank1.generations] == [2**64 - 1]  # (2^64 - 1) % 2 == 1
    assert list(rank0.generations) == [] and [g.request_id for g in merged.generations] == [2**64 - 1]
    assert not merged.HasField("batch")  # one token: finished in its Prefill


def test_generate_num_shard_2_runs_end_to_end(monkeypatch, restore_logging):
    monkeypatch.setenv("TGI_VLM_DEVICE", "cpu")
    monkeypatch.setenv("TGI_VLM_CPU_KV_CACHE_GB", "0.05")  # the ranks inherit the environment
    monkeypatch.setenv("PYTHONPATH", SHARD_ENV["PYTHONPATH"])
    result = CliRunner().invoke(cli.app, ["generate", str(tiny_model_path(ARCH)), "--num-shard", "2", "--demo",
                                          "--max-new-tokens", "3", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert "tokens: 3 (length)" in result.output.splitlines(), result.output


# Last: it ends the module's two-rank shard.
def test_sigterm_to_one_rank_while_serving_ends_both_ranks_cleanly(shards, counter):
    pair, _ = shards
    long_request = RequestParams(["keep talking"], max_new_tokens=250, ignore_eos=True)

    async def scenario():
        client = await connect(pair.socket(0))
        router = Router(client, counter.count, CONFIG)
        await router.start()
        loop = asyncio.create_task(router.run())
        try:
            stream = await router.submit(long_request)
            for _ in range(3):
                await stream.entry.events.get()  # decoding on both ranks
            pair.processes[1].send_signal(signal.SIGTERM)
            return await stream.final()
        finally:
            router.stop()
            await loop
            await client.close()

    tokens, final = asyncio.run(asyncio.wait_for(scenario(), EXIT_BOUND_S))
    codes = [process.wait(EXIT_BOUND_S) for process in pair.processes]
    assert codes == [0, 0], pair.log_text()
    assert not final.ok, final
    log0 = pair.logs[0].read_text()
    assert "rank 1 shut down" in log0 and "rank 0 left the process group" in log0
    assert not any(os.path.exists(pair.socket(rank)) for rank in range(2))
