"""TGI's `parameters.grammar` and OpenAI's `response_format` → the shard's (grammar, grammar_type).

TGI's HTTP shapes: `{"type": "json", "value": SCHEMA}`, `{"type": "regex", "value": "..."}`,
`{"type": "json_schema", "value": {"name": ..., "schema": SCHEMA}}`; chat's `response_format` takes
those and OpenAI's own (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {...}}`).
TGI's router compiles a JSON Schema to a regex; our shard enforces JSON Schemas itself, so they
travel as GRAMMAR_TYPE_JSON (the schema text) and regexes as GRAMMAR_TYPE_REGEX.
"""

from __future__ import annotations

import json
from typing import Any

from tgi_vlm.api.errors import validation_error

GRAMMAR_TYPE_NONE, GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX = 0, 1, 2
ANY_JSON_OBJECT = {"type": "object"}


def grammar_fields(grammar: dict[str, Any] | None) -> tuple[str, int]:
    """(grammar text, proto grammar_type) for a TGI `grammar` parameter; 422 when malformed."""
    if grammar is None:
        return "", GRAMMAR_TYPE_NONE
    kind, value = grammar.get("type"), grammar.get("value")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise validation_error("grammar of type `regex` needs a non-empty string `value`")
        return value, GRAMMAR_TYPE_REGEX
    if kind == "json_schema" and isinstance(value, dict) and "schema" in value:
        value = value["schema"]
    if kind in ("json", "json_object", "json_schema"):
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise validation_error(f"grammar of type `{kind}` needs a JSON Schema object as `value`")
        return json.dumps(schema), GRAMMAR_TYPE_JSON
    raise validation_error(f"unknown grammar type {kind!r}: use `json`, `json_schema` or `regex`")


def response_format_grammar(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` as a TGI grammar parameter (None: free text)."""
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "json", "value": response_format.get("value") or ANY_JSON_OBJECT}
    if kind == "json_schema":
        spec = response_format.get("value") or response_format.get("json_schema") or {}
        return {"type": "json", "value": spec.get("schema", spec) if isinstance(spec, dict) else spec}
    return dict(response_format)  # TGI's own shapes ("json", "regex") pass through to grammar_fields
