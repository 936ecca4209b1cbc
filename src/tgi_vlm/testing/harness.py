"""Helpers that drive an engine the way the server does, for tests and benchmarks.

`make_request` builds a `generate_pb2.Request` from text and images; `Runner` keeps a cached
batch and plays Prefill / Prefill(new, cached) / Decode / FilterBatch against a model directly,
collecting generated ids and per-step logits by request id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.requests import build_request


def make_request(
    request_id: int,
    *chunks: str | bytes,
    max_new_tokens: int = 8,
    ignore_eos: bool = True,
    truncate: int = 0,
    chunk_len: int | None = None,
    prefill_logprobs: bool = False,
    top_n_tokens: int = 0,
    stop_sequences: Sequence[str] = (),
    add_special_tokens: bool = True,
    mimetype: str = "image/png",
    **parameters,
) -> pb.Request:
    """Text chunks are str, images are bytes, in prompt order. `parameters` go to NextTokenChooserParameters."""
    return build_request(
        request_id, chunks, parameters=parameters, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
        truncate=truncate, chunk_len=chunk_len, prefill_logprobs=prefill_logprobs, top_n_tokens=top_n_tokens,
        stop_sequences=stop_sequences, add_special_tokens=add_special_tokens, mimetype=mimetype,
    )


def make_batch(batch_id: int, requests: list[pb.Request]) -> pb.Batch:
    return pb.Batch(id=batch_id, requests=requests, size=len(requests))


class Runner:
    """Plays the router's calls against a model in-process and records what comes back."""

    def __init__(self, model):
        self.model = model
        self.batch = None
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.logits: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.generations: dict[int, list] = defaultdict(list)
        self.finished: dict[int, object] = {}
        model.logits_observer = self._observe

    def _observe(self, request_ids: list[int], logits: torch.Tensor) -> None:
        for rid, row in zip(request_ids, logits):
            self.logits[rid].append(row.detach().clone())

    def _record(self, generations) -> None:
        for g in generations:
            self.generations[g.request_id].append(g)
            self.tokens[g.request_id].extend(g.tokens.ids)
            if g.generated_text is not None:
                self.finished[g.request_id] = g.generated_text

    def prefill(self, requests: list[pb.Request], batch_id: int = 1) -> None:
        """Prefill(new, cached_batch=current): the new batch joins the running one in the same forward."""
        new = self.model.batch_from_pb(make_batch(batch_id, requests))
        batch = new if self.batch is None else self.model.concatenate([self.batch, new])
        self.step(batch)

    def step(self, batch=None) -> None:
        gens, self.batch, _ = self.model.generate_token(self.batch if batch is None else batch)
        self._record(gens)
        if self.batch is not None:
            done = [rid for rid in self.batch.request_ids if rid in self.finished]
            if done:  # the router filters finished requests out after every step
                self.filter([rid for rid in self.batch.request_ids if rid not in self.finished])

    def filter(self, keep: list[int]) -> None:
        if not keep:
            self.batch.release()
            self.batch = None
        else:
            self.batch = self.batch.filter(keep)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.batch is None:
                return
            self.step()
        raise RuntimeError("generation did not finish")
