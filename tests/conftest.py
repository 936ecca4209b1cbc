"""Shared fixtures: tiny models built offline once per session, engines loaded once per module."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(min(2, os.cpu_count() or 1))

# CI must be reproducible: property tests draw the same examples on every run and keep no database.
# HYPOTHESIS_PROFILE=explore draws fresh examples (and remembers failures) when hunting locally.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory):
    """Build tiny models into a per-run directory unless the caller chose a cache."""
    if "TGI_VLM_TINY_CACHE" not in os.environ:
        os.environ["TGI_VLM_TINY_CACHE"] = str(tmp_path_factory.mktemp("tiny-models"))
    yield


# Shards started by tests compare with transformers in float32 (or with figures measured in float32): pinned,
# since the default dtype on a CPU with native bf16 is bfloat16.
FLOAT32_SHARD_ARGS = ["--dtype", "float32"]


def load_engine(arch: str, **config_overrides):
    """The engine for `arch`'s tiny model, in float32 unless `dtype` says otherwise: the parity tests compare
    with transformers in float32 (token-exact, logits within 1e-4), and the default dtype on a CPU with
    native bf16 is bfloat16."""
    from tgi_vlm.config import EngineConfig
    from tgi_vlm.models import get_model
    from tgi_vlm.testing import tiny_model_path

    config = EngineConfig(**{"device": "cpu", "cpu_kv_cache_bytes": 32 << 20, "dtype": "float32", **config_overrides})
    return get_model(str(tiny_model_path(arch)), config)


@pytest.fixture
def restore_logging():
    """For tests that run the CLI in-process: the commands point loguru at the runner's streams, which
    are closed afterwards; put loguru back on stderr."""
    yield
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr)
