"""A real shard process, started the way TGI's launcher starts it, driven over its unix socket.

One process serves the whole module (loading torch and the model is the slow part): the router's
startup sequence, a generation session with every RPC, refused inputs that leave the shard
serving, and finally SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.models.reference import hf_greedy
from tests.models.test_text_generation_features import router_warmup
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import make_batch, make_request

BLOCK_SIZE = 16
KV_CACHE_GB = 0.05
LAUNCHER_ENV = {
    "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
    "CUDA_MEMORY_FRACTION": "1", "PREFIX_CACHING": "1", "ATTENTION": "paged",  # the launcher's default for text
    "TGI_VLM_CPU_KV_CACHE_GB": str(KV_CACHE_GB), "TGI_VLM_DEVICE": "cpu",
}  # fmt: skip
# Prompts used for parity with transformers greedy (EOS neither stops nor is masked on either side).
# The shard runs this checkout's package, not wherever an installed console script's import path points.
CHECKOUT_PYTHONPATH = os.pathsep.join(
    p for p in (str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH")) if p)
PROMPTS = ["hello world this is", "numbers 1 2 3 and 4", "the quick brown fox jumps over the lazy dog and then some more words"]


@dataclass
class RealShard:
    process: subprocess.Popen
    stub: generate_pb2_grpc.TextGenerationServiceStub
    socket_path: str
    stdout_path: Path
    model_dir: Path


def _wait_for_socket(path: str, process: subprocess.Popen, stdout: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert process.poll() is None, f"shard exited with {process.returncode}:\n{stdout.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def shard():
    model_dir = tiny_model_path("llama")
    directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")  # unix socket paths must stay short
    base, stdout_path = f"{directory}/s", Path(directory) / "stdout"
    script = Path(sys.executable).parent / "text-generation-server"
    with open(stdout_path, "w") as stdout:
        process = subprocess.Popen(
            [str(script), "serve", str(model_dir), "--uds-path", base, "--logger-level", "INFO", "--json-output",
             *FLOAT32_SHARD_ARGS],
            env={**os.environ, **LAUNCHER_ENV, "PYTHONPATH": CHECKOUT_PYTHONPATH}, stdout=stdout,
            stderr=subprocess.DEVNULL, umask=0,  # the socket must be owner-only whatever the launcher's umask
        )
    channel = None
    try:
        _wait_for_socket(f"{base}-0", process, stdout_path)
        channel = grpc.insecure_channel(f"unix://{base}-0")
        yield RealShard(process, generate_pb2_grpc.TextGenerationServiceStub(channel), f"{base}-0", stdout_path,
                        model_dir)
    finally:
        if channel is not None:
            channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(shard):
    model = AutoModelForCausalLM.from_pretrained(shard.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(shard.model_dir)

    def greedy(text: str, n: int) -> list[int]:
        return hf_greedy(model, dict(tokenizer(text, return_tensors="pt")), n).ids

    return greedy


class Blocks:
    """The router's side of KV allocation: whole blocks per request, block 0 never handed out."""

    def __init__(self) -> None:
        self.next_block = 1

    def assign(self, request: pb.Request, num_tokens: int) -> pb.Request:
        count = -(-num_tokens // BLOCK_SIZE)
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        request.blocks[:] = blocks
        request.slots[:] = [b * BLOCK_SIZE + j for b in blocks for j in range(BLOCK_SIZE)]
        return request


def routed(blocks: Blocks, rid: int, text: str, max_new_tokens: int, **kwargs) -> pb.Request:
    return blocks.assign(make_request(rid, text, max_new_tokens=max_new_tokens, **kwargs), 64 + max_new_tokens)


class Session:
    """Collects generations and plays the router's loop: decode, filter finished, clear when empty."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, pb.GeneratedText] = {}
        self.batch: pb.CachedBatch | None = None

    def record(self, response) -> None:
        for g in response.generations:
            self.tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            if g.HasField("generated_text"):
                self.finished[g.request_id] = g.generated_text
        self.batch = response.batch if response.HasField("batch") else None
        if self.batch is not None:
            keep = [rid for rid in self.batch.request_ids if rid not in self.finished]
            if len(keep) < len(self.batch.request_ids):
                self.batch = self.stub.FilterBatch(pb.FilterBatchRequest(batch_id=self.batch.id, request_ids=keep)).batch

    def prefill(self, batch: pb.Batch, with_cached: bool = False) -> None:
        request = pb.PrefillRequest(batch=batch)
        if with_cached:
            request.cached_batch.CopyFrom(self.batch)
        self.record(self.stub.Prefill(request, timeout=60))

    def decode(self) -> None:
        self.record(self.stub.Decode(pb.DecodeRequest(batches=[self.batch]), timeout=60))

    def run(self) -> None:
        while self.batch is not None:
            self.decode()


def test_the_router_startup_sequence(shard):
    response = shard.stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert list(response.urls) == [f"unix://{shard.socket_path}"]
    shard.stub.ClearCache(pb.ClearCacheRequest())
    info = shard.stub.Info(pb.InfoRequest())
    assert (info.requires_padding, info.support_chunking, info.block_size, info.speculate) == (False, True, 16, 0)
    assert (info.device_type, info.dtype, info.use_prefix_caching) == ("cpu", "float32", True)  # PREFIX_CACHING=1
    warmup = shard.stub.Warmup(router_warmup(max_input=32, max_prefill=64, max_total=64), timeout=60)
    config = json.loads((shard.model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    bytes_per_block = (2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"]
                       * config.get("head_dim", config["hidden_size"] // heads) * 4)
    num_blocks = int(KV_CACHE_GB * (1 << 30)) // bytes_per_block
    assert (warmup.max_supported_total_tokens, warmup.max_input_tokens, warmup.max_total_tokens) == (
        num_blocks * BLOCK_SIZE, 32, 64)


def test_the_socket_is_owner_only_although_the_shard_started_with_umask_0(shard):
    mode = os.stat(shard.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)


def test_the_shard_runs_this_checkout(shard):
    records = [json.loads(line) for line in shard.stdout_path.read_text().splitlines() if line.strip()]
    started = [r["record"]["file"]["path"] for r in records if "Server started" in r["record"]["message"]]
    assert started and Path(started[0]).is_relative_to(Path(__file__).parents[2] / "src"), started


def test_a_generation_session_with_every_rpc_matches_transformers(shard, reference):
    blocks, session = Blocks(), Session(shard.stub)
    session.prefill(make_batch(1, [routed(blocks, 1, PROMPTS[0], 6), routed(blocks, 2, PROMPTS[1], 4)]))
    assert list(session.batch.request_ids) == [1, 2]
    session.decode()
    session.prefill(make_batch(2, [routed(blocks, 3, PROMPTS[2], 5)]), with_cached=True)  # joins in one forward
    assert list(session.batch.request_ids) == [1, 2, 3]
    session.run()  # request 2 is filtered out after its last token, then 1 and 3 finish
    assert shard.stub.Health(pb.HealthRequest()) == pb.HealthResponse()
    for rid, (text, n) in {1: (PROMPTS[0], 6), 2: (PROMPTS[1], 4), 3: (PROMPTS[2], 5)}.items():
        assert session.tokens[rid] == reference(text, n), f"request {rid}"
        assert session.finished[rid].generated_tokens == n


def test_filter_batch_then_clear_cache_of_a_running_batch(shard, reference):
    blocks, session = Blocks(), Session(shard.stub)
    session.prefill(make_batch(5, [routed(blocks, 1, PROMPTS[0], 8), routed(blocks, 2, PROMPTS[1], 8)]))
    filtered = shard.stub.FilterBatch(pb.FilterBatchRequest(batch_id=session.batch.id, request_ids=[2])).batch
    assert (list(filtered.request_ids), filtered.size) == ([2], 1)
    session.batch = filtered
    session.decode()
    shard.stub.ClearCache(pb.ClearCacheRequest(id=filtered.id))
    error = _rpc_error(lambda: shard.stub.Decode(pb.DecodeRequest(batches=[filtered])))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert session.tokens[2] == reference(PROMPTS[1], 2)


def _rpc_error(call) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def _prefill_error(shard, request: pb.Request) -> grpc.RpcError:
    return _rpc_error(lambda: shard.stub.Prefill(pb.PrefillRequest(batch=make_batch(9, [request])), timeout=60))


def _assert_still_serving(shard, reference) -> None:
    session = Session(shard.stub)
    session.prefill(make_batch(10, [routed(Blocks(), 50, PROMPTS[0], 2)]))
    session.run()
    assert session.tokens[50] == reference(PROMPTS[0], 2)


def test_decode_of_an_unknown_batch_is_not_found_and_the_shard_keeps_serving(shard, reference):
    error = _rpc_error(lambda: shard.stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=12345)])))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "12345" in error.details()
    _assert_still_serving(shard, reference)


@pytest.mark.parametrize(
    ("text", "kwargs", "reason"),
    [
        ("", dict(add_special_tokens=False), "empty input"),
        (PROMPTS[0], dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        (PROMPTS[0], dict(top_p=1.5), "top_p must be in (0, 1]"),
        (PROMPTS[0], dict(temperature=-1.0), "temperature must be >= 0"),
    ],
    ids=["empty-input", "max-new-tokens-0", "top-p-1.5", "negative-temperature"],
)
def test_a_bad_request_is_invalid_argument_naming_it_and_the_shard_keeps_serving(shard, reference, text, kwargs,
                                                                                 reason):
    request = routed(Blocks(), 77, text, kwargs.pop("max_new_tokens", 4), **kwargs)
    error = _prefill_error(shard, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 77" in error.details() and reason in error.details()
    _assert_still_serving(shard, reference)


def test_more_tokens_than_the_given_slots_is_invalid_argument(shard, reference):
    request = make_request(78, PROMPTS[2], max_new_tokens=20)
    request.blocks[:] = [1]
    request.slots[:] = range(BLOCK_SIZE, 2 * BLOCK_SIZE)
    error = _prefill_error(shard, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 78" in error.details() and f"gave {BLOCK_SIZE}" in error.details()
    _assert_still_serving(shard, reference)


def test_truncate_longer_than_the_input_is_served(shard, reference):
    session = Session(shard.stub)
    session.prefill(make_batch(11, [routed(Blocks(), 79, PROMPTS[1], 4, truncate=1000)]))
    session.run()
    assert session.tokens[79] == reference(PROMPTS[1], 4)


def test_sigterm_exits_cleanly_removes_the_socket_and_logged_json(shard):
    shard.process.send_signal(signal.SIGTERM)
    assert shard.process.wait(timeout=30) == 0
    assert not os.path.exists(shard.socket_path)
    lines = [line for line in shard.stdout_path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r["record"]["level"]["name"], str) for r in records)
    assert any("Server started at unix://" in r["text"] for r in records)
    assert any("Server stopped" in r["text"] for r in records)
