"""Fixtures shared by the parity modules: each module picks its architectures with an `arch`
fixture; `engine` loads it once per module and `runner` checks, after every test, that every
server-allocated KV block (requests sent without blocks, as `make_request` builds them) and every
encoder-cache entry came back. Blocks a test hands out itself (`prefix_routing.RoutedBlocks`) are
not the shard's to free and are not counted."""

from __future__ import annotations

import pytest

from tests.conftest import load_engine
from tests.models.prefix_routing import RoutedBlocks
from tgi_vlm.testing.harness import Runner


@pytest.fixture(scope="module")
def engine(arch):
    return load_engine(arch)


@pytest.fixture
def runner(engine):
    r = Runner(engine)
    yield r
    if r.batch is not None:
        r.batch.release()
    engine.prefill_budget = 4096
    assert engine.kv_blocks_in_use == 0, "KV blocks leaked"
    cache = getattr(engine, "encoder_cache", None)
    assert cache is None or cache.num_entries == 0, "encoder-cache entries leaked"


@pytest.fixture
def routed(engine):
    return RoutedBlocks(engine)


@pytest.fixture
def computed(engine, monkeypatch):
    """Tokens fed to the model per step (what the forward actually computed)."""
    sizes: list[int] = []
    real = engine.embed_step
    monkeypatch.setattr(engine, "embed_step", lambda batch, step: sizes.append(step.input_ids.numel()) or real(batch, step))
    return sizes
