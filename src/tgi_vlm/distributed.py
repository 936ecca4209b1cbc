"""The process group of a sharded shard (`serve --sharded`, one process per rank, as TGI's launcher starts them).

The launcher gives each shard RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Ranks meet over
torch.distributed: NCCL on CUDA, gloo on CPU. Every rank receives the same RPCs from the router and
must take the same decisions from them; the model's collectives (all-reduce, all-gather) are where
they meet, so a rank that diverged would hang the others there.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from loguru import logger


@dataclass(frozen=True)
class ShardGroup:
    rank: int = 0
    world_size: int = 1

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def owns(self, request_id: int) -> bool:
        """TGI's rule: rank r emits the Generations of requests with `id % world_size == r`."""
        return request_id % self.world_size == self.rank


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def initialize(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
               timeout_s: float) -> ShardGroup:
    """Join the default process group (once per process); a world of one joins nothing."""
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    group = ShardGroup(rank, world_size)
    if world_size == 1 or dist.is_initialized():
        return group
    backend = backend_for(device)
    kwargs = {}
    if backend == "nccl":  # gloo takes no device_id (passing a CUDA one there is a known launcher bug)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    logger.info("rank {}/{} joined the {} process group at {}:{}", rank, world_size, backend, master_addr, master_port)
    return group
