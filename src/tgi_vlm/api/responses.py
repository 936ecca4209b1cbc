"""Response bodies with TGI's field names and order (router/src/lib.rs: GenerateResponse, Details,
StreamResponse, ChatCompletion, ChatCompletionChunk, CompletionFinal, Chunk).

Logprobs that are not numbers (the first prompt token has none) are null, as serde writes NaN.
OpenAI routes report an EOS finish as "stop" (TGI's `FinishReason::format(true)`).
"""

from __future__ import annotations

import math
import time

from tgi_vlm.api.infer import Generation
from tgi_vlm.api.tools import Reply
from tgi_vlm.api.tools import finish_reason as tool_finish_reason
from tgi_vlm.api.validation import ValidRequest
from tgi_vlm.router.requests import FinalEvent, Token, TokenEvent


def _logprob(value: float) -> float | None:
    return value if math.isfinite(value) else None


def token_json(token: TokenEvent | Token) -> dict:
    token_id = token.token_id if isinstance(token, TokenEvent) else token.id
    return {"id": token_id, "text": token.text, "logprob": _logprob(token.logprob), "special": token.special}


def prefill_json(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": _logprob(token.logprob)}


def openai_finish_reason(final: FinalEvent) -> str:
    return "stop" if final.finish_reason == "eos_token" else final.finish_reason


def output_text(final: FinalEvent, valid: ValidRequest) -> str:
    return valid.inputs + final.text if valid.return_full_text else final.text


# ----- /generate, /generate_stream, / -----

def generate_response(gen: Generation, valid: ValidRequest, others: list[Generation] | None = None) -> dict:
    """TGI's GenerateResponse; with best_of, `others` are the sequences not chosen (`best_of_sequences`)."""
    body: dict = {"generated_text": output_text(gen.final, valid)}
    if valid.details:
        details = {"finish_reason": gen.final.finish_reason, "generated_tokens": gen.final.generated_tokens,
                   "seed": gen.final.seed, **_token_details(gen, valid)}
        if others is not None:
            details["best_of_sequences"] = [
                {"generated_text": output_text(g.final, valid), "finish_reason": g.final.finish_reason,
                 "generated_tokens": g.final.generated_tokens, "seed": g.final.seed, **_token_details(g, valid)}
                for g in others]
        body["details"] = details
    return body


def _token_details(gen: Generation, valid: ValidRequest) -> dict:
    details: dict = {"prefill": [prefill_json(t) for t in gen.final.prefill] if valid.decoder_input_details else [],
                     "tokens": [token_json(t) for t in gen.tokens]}
    if any(t.top_tokens for t in gen.tokens):
        details["top_tokens"] = [[token_json(x) for x in t.top_tokens] for t in gen.tokens]
    return details


def best_of(generations: list[Generation]) -> int:
    """TGI's rule: the highest mean logprob of the generated tokens; the first on ties."""
    means = [sum(t.logprob for t in g.tokens) / max(len(g.tokens), 1) for g in generations]
    return max(range(len(means)), key=lambda i: (means[i], -i))


def stream_response(index: int, token: TokenEvent, final: FinalEvent | None, valid: ValidRequest) -> dict:
    body: dict = {"index": index, "token": token_json(token)}
    if token.top_tokens:
        body["top_tokens"] = [token_json(x) for x in token.top_tokens]
    body["generated_text"] = output_text(final, valid) if final is not None else None
    body["details"] = None
    if final is not None and valid.details:
        body["details"] = {"finish_reason": final.finish_reason, "generated_tokens": final.generated_tokens,
                           "seed": final.seed, "input_length": final.input_length}
    return body


# ----- OpenAI: /v1/chat/completions, /v1/completions -----

def usage(final: FinalEvent) -> dict:
    return {"prompt_tokens": final.input_length, "completion_tokens": final.generated_tokens,
            "total_tokens": final.input_length + final.generated_tokens}


def shared_usage(finals: list[FinalEvent]) -> dict:
    """n sequences of one prompt: the prompt counted once (OpenAI's `usage` for n > 1)."""
    prompt, completion = finals[0].input_length, sum(f.generated_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprob_entry(token: TokenEvent) -> dict:
    return {"token": token.text, "logprob": _logprob(token.logprob),
            "top_logprobs": [{"token": t.text, "logprob": _logprob(t.logprob)} for t in token.top_tokens]}


class OpenAiBodies:
    """The fields every OpenAI-route body shares: model, fingerprint, creation time."""

    def __init__(self, model: str, fingerprint: str):
        self.model = model
        self.fingerprint = fingerprint

    def _head(self, kind: str) -> dict:
        return {"object": kind, "id": "", "created": int(time.time()), "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chat_completion(self, generations: list[Generation], logprobs: bool,
                        replies: list[Reply] | None = None) -> dict:
        """One choice per sequence; with tools, each choice's reply as read back (api/tools.py)."""
        choices = []
        for i, gen in enumerate(generations):
            reason = openai_finish_reason(gen.final)
            message: dict = {"role": "assistant", "content": gen.final.text}
            if replies is not None:
                message = {"role": "assistant", "content": replies[i].content}
                if replies[i].tool_calls:
                    message["tool_calls"] = replies[i].tool_calls
                reason = tool_finish_reason(reason, replies[i])
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": [_logprob_entry(t) for t in gen.tokens]} if logprobs else None,
                            "finish_reason": reason})
        return {**self._head("chat.completion"), "choices": choices, "usage": shared_usage([g.final for g in generations])}

    def chat_chunk(self, token: TokenEvent, final: FinalEvent | None, logprobs: bool, index: int = 0,
                   delta: dict | None = None, finish_reason: str | None = None) -> dict:
        """A token's chunk; `delta` replaces the token's text (tool replies), `finish_reason` the final's."""
        if delta is None:
            delta = {"role": "assistant", "content": "" if token.special else token.text}
        if final is not None and finish_reason is None:
            finish_reason = openai_finish_reason(final)
        choice = {"index": index, "delta": delta,
                  "logprobs": {"content": [_logprob_entry(token)]} if logprobs else None,
                  "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}

    def chat_usage_chunk(self, finals: list[FinalEvent]) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": shared_usage(finals)}

    def completion(self, generations: list[list[Generation]]) -> dict:
        """Per prompt, its n sequences; choice index = prompt index × n + sequence index (OpenAI's)."""
        flat = [g for per_prompt in generations for g in per_prompt]
        choices = [{"index": i, "text": g.final.text, "logprobs": None, "finish_reason": openai_finish_reason(g.final)}
                   for i, g in enumerate(flat)]
        total = {"prompt_tokens": sum(p[0].final.input_length for p in generations),
                 "completion_tokens": sum(g.final.generated_tokens for g in flat)}
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        return {**self._head("text_completion"), "choices": choices, "usage": total}

    def completion_chunk(self, index: int, token: TokenEvent, final: FinalEvent | None) -> dict:
        choice = {"index": index, "text": token.text, "logprobs": None,
                  "finish_reason": openai_finish_reason(final) if final is not None else ""}
        body = {**self._head("text_completion"), "choices": [choice]}
        if final is not None:
            body["usage"] = usage(final)
        return body
