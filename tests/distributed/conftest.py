"""One pair of gloo ranks for the whole directory; per model, the same engine loaded sharded (on
both ranks) and unsharded (here), so every scenario runs three times on the same messages."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.distributed import scenarios
from tests.distributed.ranks import Loaded, RankPair, load_engine
from tgi_vlm.testing import tiny_model_path


@pytest.fixture(scope="session")
def ranks():
    pair = RankPair()
    yield pair
    pair.close()


@dataclass
class ShardedModel:
    """`arch` loaded on both ranks under `key`, and once unsharded in this process."""

    ranks: RankPair
    key: str
    arch: str
    kv_heads: int | None  # the tiny model's KV-head override (None: the size's own)
    single: object  # the unsharded engine
    loaded: list[Loaded]  # per rank

    @classmethod
    def load(cls, ranks: RankPair, arch: str, *, kv_heads: int | None = None, per_rank: list[dict] | None = None,
             key: str | None = None) -> ShardedModel:
        path = str(tiny_model_path(arch, kv_heads=kv_heads))  # built here: ranks only read it
        key = key or f"{arch}-kv{kv_heads}"
        loaded = ranks.call("load", per_rank=per_rank, key=key, arch=arch, kv_heads=kv_heads)
        return cls(ranks, key, arch, kv_heads, load_engine(path), loaded)

    def run(self, scenario: str, **kwargs) -> tuple[list[scenarios.Trace], scenarios.Trace]:
        """(one trace per rank, the unsharded engine's trace) of the same scenario."""
        sharded = self.ranks.call("run", key=self.key, scenario=scenario, **kwargs)
        return sharded, scenarios.SCENARIOS[scenario](self.single, **kwargs)
