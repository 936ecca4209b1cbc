"""What a caller submits to the router and what comes back: parameters in, events out.

Imports only the generated protobuf types: the HTTP front end and the test fixtures build requests
with these without loading the engine (finish reasons are read from the wire enum, not `generation/`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tgi_vlm.media import VideoBytes
from tgi_vlm.pb import generate_pb2 as pb

Chunk = str | bytes | VideoBytes  # text, an image's bytes, a clip's bytes


@dataclass
class RequestParams:
    """One generation request. `chunks` are text (str), images (bytes) and clips (VideoBytes) in prompt order."""

    chunks: list[Chunk]
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    do_sample: bool = False
    seed: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    truncate: int = 0  # 0: no truncation (up to the router's max_input_tokens)
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    watermark: bool = False
    add_special_tokens: bool = True  # TGI's chat route sends False (the template holds the specials)
    grammar: str = ""  # as TGI's router sends it: a regex (GRAMMAR_TYPE_REGEX, 2) or a JSON Schema (1)
    grammar_type: int = 0
    adapter_id: str = ""  # the LoRA adapter to run with ("" = the base model); also keys the prefix cache

    def to_pb(self, request_id: int, allocation=None, chunk_len: int | None = None) -> pb.Request:
        return build_request(
            request_id, self.chunks,
            parameters=dict(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, typical_p=self.typical_p,
                do_sample=self.do_sample, seed=self.seed, repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty, watermark=self.watermark,
                grammar=self.grammar, grammar_type=self.grammar_type,
            ),
            max_new_tokens=self.max_new_tokens, stop_sequences=self.stop_sequences, ignore_eos=self.ignore_eos,
            truncate=self.truncate, prefill_logprobs=self.prefill_logprobs, top_n_tokens=self.top_n_tokens,
            add_special_tokens=self.add_special_tokens,
            blocks=allocation.blocks if allocation is not None else (),
            slots=allocation.slots if allocation is not None else (),
            chunk_len=chunk_len,
            cache_len=allocation.cache_len if allocation is not None else 0,
            adapter_id=self.adapter_id,
        )


def build_request(request_id: int, chunks: Sequence[Chunk], *, parameters: dict | None = None,
                  max_new_tokens: int = 16, stop_sequences: Sequence[str] = (), ignore_eos: bool = False,
                  truncate: int = 0, prefill_logprobs: bool = False, top_n_tokens: int = 0,
                  add_special_tokens: bool = True, blocks: Sequence[int] = (), slots: Sequence[int] = (),
                  chunk_len: int | None = None, cache_len: int = 0, mimetype: str = "image/png",
                  adapter_id: str = "") -> pb.Request:
    """The one place a `generate_pb2.Request` is built from text (str), image (bytes) and clip (VideoBytes)
    chunks in prompt order, as TGI's router sends it (`inputs` holds the text, `input_chunks` everything).
    `adapter_id` "" leaves the optional field unset, as TGI's router does for no adapter."""
    input_chunks = [_input_chunk(c, mimetype) for c in chunks]
    request = pb.Request(
        id=request_id,
        inputs="".join(c for c in chunks if isinstance(c, str)),
        input_chunks=pb.Input(chunks=input_chunks),
        truncate=truncate,
        parameters=pb.NextTokenChooserParameters(**(parameters or {})),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, stop_sequences=list(stop_sequences), ignore_eos_token=ignore_eos
        ),
        prefill_logprobs=prefill_logprobs,
        top_n_tokens=top_n_tokens,
        add_special_tokens=add_special_tokens,
        blocks=list(blocks),
        slots=list(slots),
        cache_len=cache_len,  # leading positions already in `blocks` (the router's prefix cache)
    )
    if chunk_len is not None:
        request.chunk_len = chunk_len
    if adapter_id:
        request.adapter_id = adapter_id
    return request


@dataclass(frozen=True)
class Token:
    """A prompt token (`prefill`) or one of the top-n alternatives of a generated token."""

    id: int
    text: str
    logprob: float  # NaN for the first prompt token (nothing precedes it)
    special: bool = False


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token_id: int
    text: str
    logprob: float
    special: bool
    time: float  # time.perf_counter() when the router received it
    top_tokens: tuple[Token, ...] = ()  # the `top_n_tokens` most likely tokens at this step


def tokens_from_pb(tokens: pb.Tokens) -> tuple[Token, ...]:
    n = len(tokens.ids)
    texts = list(tokens.texts) + [""] * (n - len(tokens.texts))
    logprobs = list(tokens.logprobs) + [0.0] * (n - len(tokens.logprobs))
    special = list(tokens.is_special) + [False] * (n - len(tokens.is_special))
    return tuple(Token(i, t, lp, bool(s)) for i, t, lp, s in zip(tokens.ids, texts, logprobs, special))


def finish_reason_name(value: int) -> str:
    """A wire `FinishReason` as TGI's API spells it: "length", "eos_token", "stop_sequence"."""
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


@dataclass(frozen=True)
class FinalEvent:
    """The last event of every stream: the generated text, or why there is none."""

    request_id: int
    time: float
    text: str = ""
    generated_tokens: int = 0
    finish_reason: str | None = None  # "length" | "eos_token" | "stop_sequence"
    seed: int | None = None
    error: str | None = None  # set when the request failed or was cancelled
    cancelled: bool = False
    refused: bool = False  # the request itself was invalid (router validation or the shard's INVALID_ARGUMENT)
    input_length: int = 0  # prompt tokens, as counted for the request's KV allocation
    prefill: tuple[Token, ...] = ()  # prompt tokens with logprobs, when `prefill_logprobs` was asked for

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_pb(cls, request_id: int, generated: pb.GeneratedText, *, input_length: int = 0,
                prefill: tuple[Token, ...] = ()) -> FinalEvent:
        return cls(
            request_id=request_id,
            time=time.perf_counter(),
            text=generated.text,
            generated_tokens=generated.generated_tokens,
            finish_reason=finish_reason_name(generated.finish_reason),
            seed=generated.seed if generated.HasField("seed") else None,
            input_length=input_length,
            prefill=prefill,
        )

    @classmethod
    def failed(cls, request_id: int, error: str, *, cancelled: bool = False, refused: bool = False) -> FinalEvent:
        return cls(request_id=request_id, time=time.perf_counter(), error=error, cancelled=cancelled, refused=refused)


Event = TokenEvent | FinalEvent


def _input_chunk(chunk: Chunk, image_mimetype: str) -> pb.InputChunk:
    if isinstance(chunk, str):
        return pb.InputChunk(text=chunk)
    if isinstance(chunk, VideoBytes):  # a tgi-vlm superset field: TGI's routers never send it
        return pb.InputChunk(video=pb.Video(data=chunk.data, mimetype=chunk.mimetype))
    return pb.InputChunk(image=pb.Image(data=chunk, mimetype=image_mimetype))
