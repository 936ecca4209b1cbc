"""A deterministic stand-in for the engine: the ShardModel contract without torch.

Each request generates token id `request_id * 100 + step` until `max_new_tokens`; a request
whose `inputs` is "bad" is refused by `batch_from_pb`. Knobs let a test make the next forward
fail or block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tgi_vlm.errors import InvalidBatch, InvalidRequest
from tgi_vlm.generation import FinishReason
from tgi_vlm.models.types import GeneratedText, Generation, ShardModel, StepTimings, Tokens
from tgi_vlm.pb import generate_pb2


@dataclass
class FakeRequest:
    request_id: int
    max_new_tokens: int
    generated: int = 0

    @property
    def finished(self) -> bool:
        return self.generated >= self.max_new_tokens


@dataclass
class FakeBatch:
    batch_id: int
    requests: list[FakeRequest]
    model: FakeModel
    released: bool = field(default=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def request_ids(self) -> list[int]:
        return [r.request_id for r in self.requests]

    def filter(self, request_ids: list[int]) -> FakeBatch:
        keep = set(request_ids)
        self.requests = [r for r in self.requests if r.request_id in keep]
        return self

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.model.released.append(self.batch_id)

    def to_pb(self) -> generate_pb2.CachedBatch:
        return generate_pb2.CachedBatch(
            id=self.batch_id, request_ids=self.request_ids, size=len(self), max_tokens=10 * len(self),
            current_tokens=len(self),
        )


class FakeModel(ShardModel):
    def __init__(self) -> None:
        self.released: list[int] = []  # batch ids, in release order
        self.built: list[int] = []  # batch ids batch_from_pb built, in order
        self.forwards: list[list[int]] = []  # request ids of each forward
        self.fail_next_forward: Exception | None = None
        self.forward_started = threading.Event()
        self.forward_may_finish = threading.Event()
        self.forward_may_finish.set()
        self.idle_releases = 0  # calls of release_idle

    def release_idle(self) -> None:
        self.idle_releases += 1

    def info(self) -> generate_pb2.InfoResponse:
        return generate_pb2.InfoResponse(
            requires_padding=False, dtype="float32", device_type="cpu", speculate=0, support_chunking=True,
            use_prefix_caching=False, attention_impl="torch", block_size=16,
        )

    def batch_from_pb(self, pb: generate_pb2.Batch) -> FakeBatch:
        errors = [InvalidRequest(r.id, "inputs are 'bad'") for r in pb.requests if r.inputs == "bad"]
        if errors:
            raise InvalidBatch(errors)
        requests = [FakeRequest(r.id, r.stopping_parameters.max_new_tokens) for r in pb.requests]
        self.built.append(pb.id)
        return FakeBatch(pb.id, requests, self)

    def concatenate(self, batches: list[FakeBatch]) -> FakeBatch:
        return FakeBatch(batches[0].batch_id, [r for b in batches for r in b.requests], self)

    def warmup(self, request: generate_pb2.WarmupRequest) -> tuple[int | None, int, int]:
        max_input = request.max_input_tokens if request.HasField("max_input_tokens") else 100
        max_total = request.max_total_tokens if request.HasField("max_total_tokens") else 200
        return 4096, max_input, max_total

    def generate_token(self, batch: FakeBatch) -> tuple[list[Generation], FakeBatch | None, StepTimings]:
        self.forward_started.set()
        self.forward_may_finish.wait(timeout=30)
        if self.fail_next_forward is not None:
            exc, self.fail_next_forward = self.fail_next_forward, None
            raise exc
        self.forwards.append(batch.request_ids)
        generations = [self._step(r) for r in batch.requests]
        next_batch = None if all(r.finished for r in batch.requests) else batch
        return generations, next_batch, StepTimings(forward_ns=11, decode_ns=22, total_ns=33)

    @staticmethod
    def _step(request: FakeRequest) -> Generation:
        token = request.request_id * 100 + request.generated
        request.generated += 1
        done = None
        if request.finished:
            done = GeneratedText(text=f"t{token}", generated_tokens=request.generated,
                                 finish_reason=FinishReason.LENGTH, seed=None)
        return Generation(request.request_id, None, Tokens([token], [0.0], [f"t{token}"], [False]), done)
