"""Property-based check over random request mixes: arrivals mid-decode, chunk budgets that split
images, filtering. Invariants: no crash, every greedy request equals transformers alone, and the
KV blocks and encoder entries all come back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import load_engine
from tests.models.vlm_reference import hf_reference
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

IMAGES = [png_bytes(make_test_image(w, h, seed=i)) for i, (w, h) in enumerate([(20, 20), (40, 28), (28, 60)])]
WORDS = ["look", "at", "this", "picture", "and", "tell", "me", "more", "about", "it", "please"]

request_strategy = st.tuples(
    st.lists(st.one_of(st.sampled_from(WORDS), st.integers(0, len(IMAGES) - 1)), min_size=1, max_size=6),
    st.integers(1, 6),  # max_new_tokens
    st.integers(0, 3),  # arrives after this many steps
)


def to_chunks(parts) -> tuple:
    chunks = []
    for p in parts:
        chunks.append(IMAGES[p] if isinstance(p, int) else f"{p} ")
    return tuple(chunks)


@pytest.fixture(scope="module")
def engine():
    return load_engine("qwen2_vl")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=4),
    budget=st.integers(1, 24),
    drop=st.booleans(),
)
def test_random_mixes_keep_parity_and_balance(engine, requests, budget, drop):
    engine.prefill_budget = budget
    runner = Runner(engine)
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    step = 0
    dropped = None
    try:
        while pending or runner.batch is not None:
            arriving = [(i, r) for i, r in pending if r[2] <= step]
            pending = [(i, r) for i, r in pending if r[2] > step]
            if arriving:
                new = [make_request(i, *to_chunks(r[0]), max_new_tokens=r[1], chunk_len=budget) for i, r in arriving]
                runner.prefill(new, batch_id=100 + step)
            elif runner.batch is not None:
                runner.step()
            if drop and dropped is None and runner.batch is not None and len(runner.batch) > 1:
                dropped = runner.batch.request_ids[-1]
                runner.filter(runner.batch.request_ids[:-1])
            step += 1
        for i, (parts, n, _) in enumerate(requests):
            if i != dropped:
                assert runner.tokens[i] == hf_reference("qwen2_vl", to_chunks(parts), n).ids, f"request {i}"
    finally:
        if runner.batch is not None:
            runner.batch.release()
        engine.prefill_budget = 4096
    assert engine.kv_blocks_in_use == 0
    assert engine.encoder_cache.num_entries == 0
