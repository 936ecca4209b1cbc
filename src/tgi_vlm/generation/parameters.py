"""Request parameters: proto3 defaults resolved once, and validation with readable messages.

Proto3 sends unset floats as 0.0, so 0 means "off" for every knob here (as TGI reads them):
temperature 0 → 1.0, top_k 0 → off, top_p/typical_p 0 or 1.0 → off, repetition_penalty 0 → 1.0,
frequency_penalty 0 → off, an empty logit_bias map → off.

`logit_bias` (field 12, `map<string, int32>`) is keyed by token ids written in decimal, as TGI's
router sends them; a key is valid when it parses as TGI's router parses it (Rust's `u32`: ASCII
digits, an optional leading `+`) and names a token of the model's vocabulary.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_TOKEN_ID = re.compile(r"\+?[0-9]+")

_FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParameters:
    """One request's token-selection settings with proto3 zeros already turned into "off" values."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    do_sample: bool = False
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id; () = off

    @classmethod
    def from_params(cls, params: Any) -> SamplingParameters:
        """Read a NextTokenChooserParameters-like object (only its attributes are used)."""
        return cls(
            temperature=float(params.temperature) or 1.0,
            top_k=int(params.top_k),
            top_p=float(params.top_p) or 1.0,
            typical_p=float(params.typical_p) or 1.0,
            repetition_penalty=float(params.repetition_penalty) or 1.0,
            frequency_penalty=float(params.frequency_penalty),
            watermark=bool(params.watermark),
            do_sample=bool(params.do_sample),
            seed=int(params.seed),
            logit_bias=_logit_bias(params),
        )

    @property
    def has_warpers(self) -> bool:
        """Temperature/top-k/top-p/typical-p; like TGI, any of them turns sampling on."""
        return self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0


def validate_parameters(params: Any, stopping: Any, vocab_size: int) -> list[str]:
    """Problems with one request's parameters, as sentences; an empty list means it can run."""
    problems = [
        f"{name} must be a finite number, got {getattr(params, name)}"
        for name in _FLOAT_FIELDS
        if not math.isfinite(float(getattr(params, name)))
    ]
    bad = {p.split(" ", 1)[0] for p in problems}
    problems += _range_problems(params, vocab_size, skip=bad)
    if stopping.max_new_tokens == 0:
        problems.append("max_new_tokens must be at least 1")
    if any(s == "" for s in stopping.stop_sequences):
        problems.append("stop_sequences must not contain an empty string")
    problems += _grammar_problems(params)
    problems += _logit_bias_problems(params, vocab_size)
    return problems


def parse_token_id(key: str) -> int | None:
    """A logit_bias key as a token id, or None when it is not a decimal id (TGI router's rule)."""
    return int(key) if _TOKEN_ID.fullmatch(key) else None


def _logit_bias(params: Any) -> tuple[tuple[int, float], ...]:
    """Validated keys → (id, bias) pairs. Keys naming the same id ("7", "07") add up, as in TGI."""
    bias = getattr(params, "logit_bias", None) or {}
    summed: dict[int, float] = {}
    for key, value in bias.items():
        token = parse_token_id(key)
        if token is None:
            raise ValueError(f"logit_bias key {key!r} is not a token id; validate_parameters first")
        summed[token] = summed.get(token, 0.0) + float(value)
    return tuple(sorted(summed.items()))


def _logit_bias_problems(params: Any, vocab_size: int) -> list[str]:
    problems = []
    for key in sorted(getattr(params, "logit_bias", None) or {}):
        token = parse_token_id(key)
        if token is None:
            problems.append(f"logit_bias key {key!r} is not a token id (a non-negative decimal integer)")
        elif token >= vocab_size:
            problems.append(f"logit_bias key {key!r} is outside the vocabulary (token ids 0..{vocab_size - 1})")
    return problems


def _grammar_problems(params: Any) -> list[str]:
    # As TGI: an empty grammar means none, whatever its type. The grammar itself is checked when
    # it compiles (generation/grammar_compiler.py).
    kind = int(params.grammar_type)
    if kind not in (0, 1, 2):
        return [f"grammar_type {kind} is unknown (0 NONE, 1 JSON, 2 REGEX)"]
    if params.grammar and kind == 0:
        return ["a grammar is given with grammar_type NONE; say JSON (1) or REGEX (2)"]
    return []


def _range_problems(params: Any, vocab_size: int, skip: set[str]) -> list[str]:
    # NaN compares false with everything, so fields already reported as non-finite are skipped.
    checks = [
        ("temperature", params.temperature < 0, f"temperature must be >= 0, got {params.temperature}"),
        ("top_p", not 0 <= params.top_p <= 1, f"top_p must be in (0, 1], got {params.top_p}"),
        ("typical_p", not 0 <= params.typical_p <= 1, f"typical_p must be in (0, 1], got {params.typical_p}"),
        (
            "repetition_penalty",
            params.repetition_penalty < 0,
            f"repetition_penalty must be > 0, got {params.repetition_penalty}",
        ),
        ("top_k", params.top_k < 0, f"top_k must be >= 0, got {params.top_k}"),
        (
            "top_k",
            params.top_k > vocab_size,
            f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}",
        ),
    ]
    return [message for name, failed, message in checks if failed and name not in skip]
