"""JSON Schemas for grammar tests and benchmarks, and the regex TGI's router would send for one.

TGI's router compiles a request's JSON Schema to a regex with outlines-core's
`json_schema::to_regex` (router/src/validation.rs, git rev ba10c619 of outlines-core, whose
json_schema code is that of the PyPI release 0.1.20: a dev dependency) and sends it as
GRAMMAR_TYPE_REGEX. `router_regex` does the same, so tests feed the shard exactly what the stock
router produces.
"""

from __future__ import annotations

import json
from typing import Any

# Ten fields, one nested object, an array, an enum, formats and patterns: a realistic extraction
# schema (benchmarks/grammar_overhead.py, benchmarks/grammar_libraries.py).
PERSON: dict[str, Any] = {
    "title": "Person",
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "[a-z0-9._]+@[a-z0-9]+\\.[a-z]{2,4}"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "created": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["id", "name", "age", "email", "active", "score", "role", "created", "address"],
}

# Small enough for tiny random models to finish in tens of tokens; still nested, with an
# optional array, an enum, a boolean, an integer and a pattern.
PROFILE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "address"],
    "additionalProperties": False,
}

# Short outputs (tens of tokens) for engine tests: nested, an enum, a boolean, a bounded string
# and a pattern, no unbounded number (random models may write digits for a long time).
BADGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "active": {"type": "boolean"},
        "door": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "active", "door"],
    "additionalProperties": False,
}


def router_regex(schema: dict[str, Any]) -> str:
    """The regex TGI's router sends for `schema` (GRAMMAR_TYPE_REGEX)."""
    from outlines_core.fsm.json_schema import build_regex_from_schema  # outlines-core==0.1.20 (dev)

    return build_regex_from_schema(json.dumps(schema))


def person_instance(i: int) -> str:
    """A valid PERSON document, different for each i, spaced as the router's regex allows."""
    doc = {
        "id": f"123e4567-e89b-12d3-a456-{i:012d}",
        "name": f"Person number {i}",
        "age": 20 + i,
        "email": f"user{i}@example.com",
        "active": i % 2 == 0,
        "score": 3.25 + i,
        "role": ["admin", "user", "guest"][i % 3],
        "created": f"2024-05-{1 + i % 28:02d}T12:30:00Z",
        "tags": [f"t{i}", "blue"],
        "address": {"street": f"{i} Main Street", "city": "Springfield", "zip": f"{10000 + i:05d}"},
    }
    return json.dumps(doc, separators=(", ", ": "))


# Two function tools' argument schemas, small enough for a tiny model to finish a call within ~40 tokens (the chat
# tools tests, tests/e2e/test_chat_tools.py, and benchmarks/chat_tools.py).
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
ADD: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}
