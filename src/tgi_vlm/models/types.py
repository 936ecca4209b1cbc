"""Engine ↔ server value types and the batch contract.

The engine produces these plain dataclasses; `to_pb` turns them into protobuf messages at the
server edge so the engine never depends on gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_vlm.generation import FinishReason
from tgi_vlm.pb import generate_pb2


@dataclass
class Tokens:
    ids: list[int]
    logprobs: list[float]
    texts: list[str]
    is_special: list[bool]

    def to_pb(self) -> generate_pb2.Tokens:
        return generate_pb2.Tokens(ids=self.ids, logprobs=self.logprobs, texts=self.texts, is_special=self.is_special)


@dataclass
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None  # only when sampling

    def to_pb(self) -> generate_pb2.GeneratedText:
        return generate_pb2.GeneratedText(
            text=self.text, generated_tokens=self.generated_tokens, finish_reason=int(self.finish_reason), seed=self.seed
        )


@dataclass
class Generation:
    """One step's output for one request (never produced for a request still mid-prefill)."""

    request_id: int
    prefill_tokens: Tokens | None
    tokens: Tokens
    generated_text: GeneratedText | None
    top_tokens: list[Tokens] = field(default_factory=list)

    def to_pb(self) -> generate_pb2.Generation:
        return generate_pb2.Generation(
            request_id=self.request_id,
            prefill_tokens=self.prefill_tokens.to_pb() if self.prefill_tokens is not None else None,
            tokens=self.tokens.to_pb(),
            generated_text=self.generated_text.to_pb() if self.generated_text is not None else None,
            top_tokens=[t.to_pb() for t in self.top_tokens],
        )


@dataclass
class StepTimings:
    """Nanoseconds spent in one generate_token call."""

    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0


class ShardModel:
    """What the gRPC service needs from a loaded model (FlashCausalLM and VlmCausalLM implement it).

    Batches are engine objects with `batch_id`, `request_ids`, `__len__`, `to_pb()` (CachedBatch),
    `filter(request_ids) -> batch`, `release()` (frees KV blocks and encoder entries), and the
    class method `concatenate(batches) -> batch`. All methods run on one thread at a time: the
    service serializes every call that touches the model.

    Ownership as the service relies on it: `release()` is idempotent. `concatenate` consumes its
    inputs (the result owns their resources; if it raises, the service releases the inputs). When
    `generate_token` raises, the service releases the batch it was given and never caches it;
    when it returns None as the next batch, the service releases the batch it was given.
    """

    def batch_from_pb(self, pb: generate_pb2.Batch):  # -> Batch; raises InvalidBatch
        raise NotImplementedError

    def concatenate(self, batches: list):  # -> Batch
        raise NotImplementedError

    def warmup(self, request: generate_pb2.WarmupRequest) -> tuple[int | None, int, int]:
        """Run the warmup batch, size the KV cache; (max_supported_total_tokens, max_input, max_total)."""
        raise NotImplementedError

    def generate_token(self, batch) -> tuple[list[Generation], object | None, StepTimings]:
        """One forward: the next batch is None when every request finished."""
        raise NotImplementedError

    def info(self) -> generate_pb2.InfoResponse:
        raise NotImplementedError

    def release_idle(self) -> None:
        """The service holds no batch any more: give back memory kept between steps (default: none)."""
        return None
