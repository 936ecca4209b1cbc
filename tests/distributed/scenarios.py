"""Router-shaped scenarios played against one engine through its model API (batch_from_pb /
generate_token / filter / concatenate, via the harness `Runner`).

Each rank of a sharded pair and the unsharded reference engine run the same function on the same
pb messages; what comes back (a `Trace`) is compared in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tgi_vlm.errors import InvalidBatch
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing.harness import Runner, make_request

SEED = 1234


@dataclass
class Trace:
    tokens: dict[int, list[int]]
    logits: dict[int, np.ndarray]  # request id → [steps, vocab], one row per sampled token
    refusals: list[str] = field(default_factory=list)  # str() of every refused Prefill, in order
    kv_blocks_in_use: int = 0  # after the scenario: every server-allocated block given back?
    encoder_entries: int = 0
    facts: dict = field(default_factory=dict)


def _trace(runner: Runner, engine, refusals=(), **facts) -> Trace:
    cache = getattr(engine, "encoder_cache", None)
    return Trace(
        tokens={rid: list(ids) for rid, ids in runner.tokens.items()},
        logits={rid: np.stack([row.numpy() for row in rows]) for rid, rows in runner.logits.items()},
        refusals=list(refusals),
        kv_blocks_in_use=engine.kv_blocks_in_use,
        encoder_entries=0 if cache is None else cache.num_entries,
        facts=facts,
    )


def join_and_filter(engine, first: tuple, second: tuple, third: tuple, budget: int) -> Trace:
    """Two requests (0 greedy, 1 seeded sampling) decode; request 2 joins mid-decode through
    Prefill(new, cached) and is prefilled in chunks of a small budget (through its image, for a
    VLM); FilterBatch then drops request 1 before it finishes; the rest run to the end.
    `facts["prefilled"]`: request 2's computed positions after each step until its prompt is done."""
    runner = Runner(engine)
    try:
        runner.prefill([make_request(0, *first, max_new_tokens=8),
                        make_request(1, *second, max_new_tokens=8, do_sample=True, temperature=0.8, seed=SEED)])
        runner.step()
        runner.step()
        engine.prefill_budget = budget
        runner.prefill([make_request(2, *third, max_new_tokens=6, chunk_len=budget)], batch_id=2)
        joined = next(s for s in runner.batch.seqs if s.request_id == 2)
        prefilled = [joined.num_computed]
        runner.step()
        prefilled.append(joined.num_computed)
        runner.filter([0, 2])
        while runner.batch is not None:
            runner.step()
            if prefilled[-1] < joined.prompt_len:
                prefilled.append(joined.num_computed)
        return _trace(runner, engine, prefilled=prefilled)
    finally:
        engine.prefill_budget = 4096
        if runner.batch is not None:
            runner.batch.release()


def refuse_then_continue(engine, running: tuple, good: tuple, bad: tuple) -> Trace:
    """Request 0 decodes; a Prefill brings good request 1 and bad request 2; when it is refused, the
    router resends request 1 alone, which joins; all run to the end."""
    runner = Runner(engine)
    refusals = []
    try:
        runner.prefill([make_request(0, *running, max_new_tokens=6)])
        runner.step()
        try:
            runner.prefill([make_request(1, *good, max_new_tokens=5), make_request(2, *bad, max_new_tokens=5)],
                           batch_id=2)
        except InvalidBatch as exc:
            refusals.append(str(exc))
            runner.prefill([make_request(1, *good, max_new_tokens=5)], batch_id=3)
        runner.run()
        return _trace(runner, engine, refusals)
    finally:
        if runner.batch is not None:
            runner.batch.release()


def fail_on_one_rank(engine, running: tuple, rank_that_fails: int) -> Trace:
    """Tokenizing a new batch raises (not a refusal) on one rank only: every rank must fail that
    Prefill instead of waiting for the failed one in the forward; the running batch goes on."""
    runner = Runner(engine)
    refusals = []
    real = engine.tokenize_request
    try:
        runner.prefill([make_request(0, *running, max_new_tokens=5)])
        if engine.layout.rank == rank_that_fails:
            engine.tokenize_request = _raise_injected
        try:
            runner.prefill([make_request(1, *running, max_new_tokens=5)], batch_id=2)
        except Exception as exc:  # noqa: BLE001 — the test compares type and message per rank
            refusals.append(f"{type(exc).__name__}: {exc}")
        engine.tokenize_request = real
        runner.run()
        return _trace(runner, engine, refusals)
    finally:
        engine.tokenize_request = real
        if runner.batch is not None:
            runner.batch.release()


def _raise_injected(request, **kwargs):
    raise RuntimeError(f"injected failure tokenizing request {request.id}")


def warmup(engine, max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int) -> Trace:
    """TGI's warmup request, then one request on the re-sized cache."""
    limits = engine.warmup(warmup_request(max_input_tokens, max_prefill_tokens, max_total_tokens))
    runner = Runner(engine)
    runner.prefill([make_request(0, "after warmup the cache is", max_new_tokens=4)])
    runner.run()
    return _trace(runner, engine, limits=limits, num_blocks=engine.kv_cache.num_blocks,
                  kv_cache_bytes=engine.kv_cache.num_blocks * engine.kv_spec.bytes_per_block)


def info(engine) -> pb.InfoResponse:
    return engine.info()


SCENARIOS = {f.__name__: f for f in (join_and_filter, refuse_then_continue, fail_on_one_rank, warmup, info)}
