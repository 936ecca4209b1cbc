"""TGI's request validation (router/src/validation.rs `Validation::validate`), same order, same words.

Parameters are checked first, then images are loaded and the prompt is counted with the shard's own
processor code (the router driver's `TokenCounter`), then lengths. The result is the router driver's
`RequestParams` plus what the response needs (input length, prompt text, detail flags).
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
from dataclasses import dataclass

from tgi_vlm.api.config import ApiConfig
from tgi_vlm.api.errors import validation_error
from tgi_vlm.api.grammar import grammar_fields
from tgi_vlm.api.images import ImageResolver
from tgi_vlm.api.schemas import Parameters
from tgi_vlm.lora.specs import unknown_adapter_message
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.tokens import CountError, PromptTokens, TokenCounter

_REQUEST_PREFIX = re.compile(r"^request \d+: ")


@dataclass(frozen=True)
class LengthLimits:
    """What Warmup settled (the shard may lower the launcher's values)."""

    max_input_tokens: int
    max_total_tokens: int


@dataclass(frozen=True)
class ValidRequest:
    params: RequestParams
    input_length: int
    inputs: str  # the request's text as sent, for return_full_text
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    prompt: PromptTokens | None = None  # ids + media spans when the router's prefix cache needs them (counted once)


class Validator:
    def __init__(self, config: ApiConfig, counter: TokenCounter, lengths: LengthLimits, images: ImageResolver,
                 *, prompt_tokens: bool = False, adapters: tuple[str, ...] = ()):
        self.config = config
        self.adapters = adapters  # the LoRA adapters the shard serves (its Info); a request may name one
        self.prompt_tokens = prompt_tokens  # the router keys its prefix cache on them: tokenize fully, once
        self.counter = counter
        self.lengths = lengths
        self.images = images
        self.takes_images = counter.prompt is not None  # text-only models keep markdown as text, as TGI does
        self.media_kinds = counter.prompt.media_kinds if counter.prompt is not None else ()

    async def validate(self, inputs: str, p: Parameters, *, add_special_tokens: bool = True,
                       stream: bool = False) -> ValidRequest:
        self.check_parameters(p, stream=stream)
        if not inputs:
            raise validation_error("`inputs` cannot be empty")
        truncate = self._truncate(p.truncate)
        chunks = await self.images.chunks(inputs, self.media_kinds) if self.takes_images else [inputs]
        params = RequestParams(
            chunks, max_new_tokens=1, temperature=_or(p.temperature, 1.0), top_k=_or(p.top_k, 0),
            top_p=_or(p.top_p, 1.0), typical_p=_or(p.typical_p, 1.0),
            repetition_penalty=_or(p.repetition_penalty, 1.0), frequency_penalty=_or(p.frequency_penalty, 0.0),
            do_sample=p.do_sample, seed=secrets.randbits(64) if p.seed is None else p.seed,
            stop_sequences=list(p.stop), truncate=truncate, prefill_logprobs=p.decoder_input_details,
            top_n_tokens=p.top_n_tokens or 0, watermark=p.watermark, add_special_tokens=add_special_tokens,
            adapter_id=p.adapter_id or "",
        )
        params.grammar, params.grammar_type = grammar_fields(p.grammar)
        prompt = await self._prompt_tokens(params) if self.prompt_tokens else None
        input_length = len(prompt) if prompt is not None else await self._count(params)
        params.max_new_tokens = self._max_new_tokens(input_length, p.max_new_tokens)
        return ValidRequest(params, input_length, inputs, p.details or p.decoder_input_details,
                            p.decoder_input_details, bool(p.return_full_text), prompt)

    def check_parameters(self, p: Parameters, *, stream: bool = False) -> None:
        """Everything that needs no tokenizer, in TGI's order."""
        best_of = 1 if p.best_of is None else p.best_of
        sampling = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
        if best_of > 1 and not sampling:
            raise validation_error("you must use sampling when `best_of` is > 1")
        if best_of != 1 and stream:
            raise validation_error("`best_of` != 1 is not supported when streaming tokens")
        if p.decoder_input_details and stream:
            raise validation_error("`decoder_input_details` == true is not supported when streaming tokens")
        if p.adapter_id and p.adapter_id not in self.adapters:
            raise validation_error(unknown_adapter_message(p.adapter_id, self.adapters))
        if p.temperature is not None and not (p.temperature > 0 and math.isfinite(p.temperature)):
            raise validation_error("`temperature` must be strictly positive")
        if p.repetition_penalty is not None and not (p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty)):
            raise validation_error("`repetition_penalty` must be strictly positive")
        if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
            raise validation_error("`frequency_penalty` must be >= -2.0 and <= 2.0")
        if p.top_p is not None and not 0.0 < p.top_p < 1.0:
            raise validation_error("`top_p` must be > 0.0 and < 1.0")
        if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
            raise validation_error("`typical_p` must be > 0.0 and < 1.0")
        if p.top_k is not None and p.top_k <= 0:
            raise validation_error("`top_k` must be strictly positive")
        if p.max_new_tokens == 0:
            raise validation_error("`max_new_tokens` must be strictly positive")
        if len(p.stop) > self.config.max_stop_sequences:
            raise validation_error(f"`stop` supports up to {self.config.max_stop_sequences} stop sequences. "
                                   f"Given: {len(p.stop)}")
        if p.top_n_tokens is not None and p.top_n_tokens > self.config.max_top_n_tokens:
            raise validation_error(f"`top_n_tokens` must be >= 0 and <= {self.config.max_top_n_tokens}. "
                                   f"Given: {p.top_n_tokens}")
        if best_of > 1 and p.seed is not None:
            raise validation_error("`seed` must not be set when `best_of` > 1")  # each sequence draws its own
        grammar_fields(p.grammar)  # 422 when malformed or not enforceable (api/grammar.py)

    def check_best_of(self, best_of: int) -> None:
        """TGI's `validate_best_of`, checked before the parameters."""
        if self.config.max_best_of == 1 and best_of != 1:
            raise validation_error("`best_of` != 1 is not allowed for this endpoint")
        if best_of > self.config.max_best_of:
            raise validation_error(f"`best_of` must be > 0 and <= {self.config.max_best_of}. Given: {best_of}")

    def _truncate(self, truncate: int | None) -> int:
        limit = self.lengths.max_input_tokens
        if truncate is not None and (truncate == 0 or truncate > limit):
            raise validation_error(f"`truncate` must be strictly positive and less than {limit}. Given: {truncate}")
        return truncate or 0

    async def _prompt_tokens(self, params: RequestParams) -> PromptTokens:
        try:
            return await asyncio.to_thread(self.counter.tokenize, params.to_pb(0))
        except CountError as exc:
            raise validation_error(_REQUEST_PREFIX.sub("", str(exc))) from None

    async def _count(self, params: RequestParams) -> int:
        return len(await self.input_ids(params))

    async def input_ids(self, params: RequestParams) -> list[int]:
        """The prompt's ids as the shard will build them (images decoded and checked on the way)."""
        try:
            return await asyncio.to_thread(self.counter.input_ids, params.to_pb(0))
        except CountError as exc:
            raise validation_error(_REQUEST_PREFIX.sub("", str(exc))) from None

    def _max_new_tokens(self, input_length: int, asked: int | None) -> int:
        total, limit = self.lengths.max_total_tokens, self.lengths.max_input_tokens
        max_new_tokens = max(total - input_length, 0) if asked is None else asked
        if input_length + max_new_tokens > total:
            raise validation_error(f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
                                   f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
        if input_length > limit:
            raise validation_error(f"`inputs` must have less than {limit} tokens. Given: {input_length}")
        return max_new_tokens


def _or(value, default):
    return default if value is None else value
