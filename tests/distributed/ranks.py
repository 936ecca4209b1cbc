"""A pair of tensor-parallel ranks (gloo, CPU) that tests drive by message, as the router drives shards.

Each rank is a spawned process that joins a gloo group through `tgi_vlm.distributed.initialize`,
loads engines with `get_model(..., EngineConfig(rank=r, world_size=2))` and runs the same
scenario (`scenarios.py`) on the same pb messages when told to; the test process compares what
every rank returns with an unsharded engine and with transformers. One pair serves every test of
the directory (starting Python, torch and a process group is the slow part).
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from dataclasses import dataclass

WORLD_SIZE = 2
CALL_TIMEOUT_S = 240  # a rank stuck in a collective gives up after COLLECTIVE_TIMEOUT_S and reports
COLLECTIVE_TIMEOUT_S = 90


@dataclass(frozen=True)
class Loaded:
    """What `load` reports about one rank's engine."""

    kv_heads: int  # KV heads per layer in this rank's cache
    kv_bytes_per_block: int
    parameter_bytes: int  # the parameters this rank holds
    checkpoint_bytes_read: int  # tensor bytes materialized from the safetensors files while loading


class RankPair:
    def __init__(self, world_size: int = WORLD_SIZE):
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        self.broken: str | None = None
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def call(self, command: str, per_rank: list[dict] | None = None, **kwargs) -> list:
        """Run `command` on every rank at once (kwargs, plus per_rank[r] on rank r); one result per rank."""
        if self.broken:
            raise RuntimeError(f"the rank pair is unusable since an earlier call failed: {self.broken}")
        for rank, conn in enumerate(self.conns):
            conn.send((command, {**kwargs, **(per_rank[rank] if per_rank else {})}))
        replies = [self._receive(rank, conn) for rank, conn in enumerate(self.conns)]
        failures = [f"rank {r}: {value}" for r, (status, value) in enumerate(replies) if status != "ok"]
        if failures:
            self.broken = f"{command}: " + " | ".join(failures)
            raise RuntimeError(self.broken)
        return [value for _, value in replies]

    def _receive(self, rank: int, conn) -> tuple[str, object]:
        if not conn.poll(CALL_TIMEOUT_S):
            return "error", f"no answer within {CALL_TIMEOUT_S} s"
        try:
            return conn.recv()
        except EOFError:
            return "error", f"the process exited (code {self.procs[rank].exitcode})"

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- inside a rank process -----

def serve(rank: int, world_size: int, port: int, conn) -> None:
    import torch

    from tgi_vlm.distributed import initialize

    torch.set_num_threads(1)  # two ranks share two cores
    initialize(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    engines: dict[str, object] = {}
    while (message := conn.recv()) is not None:
        command, kwargs = message
        try:
            conn.send(("ok", COMMANDS[command](engines, rank, world_size, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def load(engines: dict, rank: int, world_size: int, *, key: str, arch: str, kv_heads: int | None = None,
         **overrides) -> Loaded:
    from tgi_vlm.models.tensor_parallel import local_parameter_bytes
    from tgi_vlm.testing import tiny_model_path

    with CountMaterialized() as counted:
        engine = load_engine(str(tiny_model_path(arch, kv_heads=kv_heads)), rank=rank, world_size=world_size,
                             **overrides)
    engines[key] = engine
    return Loaded(engine.kv_spec.kv_heads, engine.kv_spec.bytes_per_block, local_parameter_bytes(engine.model),
                  counted.bytes)


def run(engines: dict, rank: int, world_size: int, *, key: str, scenario: str, **kwargs):
    from tests.distributed.scenarios import SCENARIOS

    return SCENARIOS[scenario](engines[key], **kwargs)


COMMANDS = {"load": load, "run": run}


def load_engine(path: str, **overrides):
    """The engine as every test here loads it: float32 pinned, a small CPU KV cache."""
    from tgi_vlm.config import EngineConfig
    from tgi_vlm.models import get_model

    return get_model(path, EngineConfig(device="cpu", dtype="float32", cpu_kv_cache_bytes=32 << 20, **overrides))


class CountMaterialized:
    """Counts the tensor bytes transformers reads out of the checkpoint while loading (its
    `spawn_materialize` turns a lazy safetensors slice into a tensor: the rank's shard, or the
    whole tensor when replicated)."""

    def __enter__(self) -> CountMaterialized:
        from transformers import core_model_loading

        self.bytes = 0
        self._module = core_model_loading
        self._original = original = core_model_loading.spawn_materialize

        def counting(thread_pool, *args, **kwargs):
            job = original(None, *args, **kwargs)

            def counted():
                tensor = job()
                if tensor is not None:
                    self.bytes += tensor.numel() * tensor.element_size()
                return tensor

            return counted if thread_pool is None else thread_pool.submit(counted)

        core_model_loading.spawn_materialize = counting
        return self

    def __exit__(self, *exc) -> None:
        self._module.spawn_materialize = self._original
