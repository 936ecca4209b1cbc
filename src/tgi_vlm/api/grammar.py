"""TGI's `parameters.grammar` and OpenAI's `response_format` → the shard's (grammar, grammar_type).

TGI's HTTP shapes: `{"type": "json", "value": SCHEMA}`, `{"type": "regex", "value": "..."}`,
`{"type": "json_schema", "value": {"name": ..., "schema": SCHEMA}}`; chat's `response_format` takes
those and OpenAI's own (`{"type": "json_object"}`: any JSON object, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`). TGI's router compiles a JSON Schema to a regex; our
shard enforces JSON Schemas itself, so they travel as GRAMMAR_TYPE_JSON (the schema text) and
regexes as GRAMMAR_TYPE_REGEX.

Every grammar is checked here with the shard's own engine (llguidance, no vocabulary needed) before
it is queued: a schema keyword the engine cannot enforce (`uniqueItems`, `not`, `if`, ...) is a 422
naming the keyword, never a silently looser output. `strict: true` also applies OpenAI's structured
output rules (every object closed with `additionalProperties: false`, every property required).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from tgi_vlm.api.errors import validation_error

GRAMMAR_TYPE_NONE, GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX = 0, 1, 2
ANY_JSON_OBJECT = {"type": "object"}
JSON_WHITESPACE = r"[ ]?"  # the shard's (generation/grammar_compiler.py): the same check, the same grammar
_WRAPPER_KEYS = {"name", "description", "strict"}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def grammar_fields(grammar: dict[str, Any] | None) -> tuple[str, int]:
    """(grammar text, proto grammar_type) for a TGI `grammar` parameter; 422 when malformed."""
    if grammar is None:
        return "", GRAMMAR_TYPE_NONE
    kind, value = grammar.get("type"), grammar.get("value")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise validation_error("grammar of type `regex` needs a non-empty string `value`")
        _check(_llguidance().LLMatcher.grammar_from_regex(value), "regex")
        return value, GRAMMAR_TYPE_REGEX
    strict = False
    if kind == "json_schema" and is_schema_wrapper(value):
        value, strict = value.get("schema", ANY_JSON_OBJECT), "schema" in value and bool(value.get("strict"))
    if kind in ("json", "json_object", "json_schema"):
        schema = _json_value(kind, value)
        check_schema(schema, "schema", strict=strict)
        return json.dumps(schema), GRAMMAR_TYPE_JSON
    raise validation_error(f"unknown grammar type {kind!r}: use `json`, `json_schema` or `regex`")


def is_schema_wrapper(value: Any) -> bool:
    """`{"name", "description"?, "schema"?, "strict"?}` (OpenAI's `json_schema`, TGI's `json_schema` value),
    as opposed to a bare JSON Schema (TGI's value, leniently). A wrapper without `schema` asks for
    any JSON object, as OpenAI's `json_schema` without one constrains nothing more than JSON."""
    return isinstance(value, dict) and ("schema" in value or set(value) <= _WRAPPER_KEYS)


def _json_value(kind: str, value: Any) -> dict:
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise validation_error(f"grammar is not valid: the `{kind}` value is not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise validation_error(f"grammar of type `{kind}` needs a JSON Schema object as `value`")
    return schema


def check_schema(schema: dict, where: str, *, strict: bool = False) -> None:
    """422 unless the shard can enforce `schema` exactly (and, when strict, OpenAI's rules hold)."""
    if strict:
        _check_strict(schema, where, "#")
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema,
                                                                   overrides={"whitespace_pattern": JSON_WHITESPACE})
    except (ValueError, TypeError) as exc:
        raise validation_error(f"grammar is not valid: {where}: {exc}") from None
    _check(grammar, where)


@functools.lru_cache(maxsize=256)
def _problem(grammar: str) -> str:
    """llguidance's complaint about a grammar ("" when none); cached, as clients resend the same tools."""
    return _llguidance().LLMatcher.validate_grammar(grammar)


def _llguidance():
    """Imported on the first grammar, not with the front end (tests/unit/test_layering.py): a server whose
    requests carry none never loads the engine's grammar library."""
    import llguidance

    return llguidance


def _check(grammar: str, where: str) -> None:
    problem = _problem(grammar)
    if not problem:
        return
    unimplemented = _UNIMPLEMENTED.search(problem)
    if unimplemented:
        keys = ", ".join(f"`{k.strip()}`" for k in unimplemented.group(1).replace('"', "").split(","))
        raise validation_error(f"grammar is not valid: {where}: the keyword {keys} cannot be enforced by the "
                               "grammar engine; remove it (or check the output yourself)")
    raise validation_error(f"grammar is not valid: {where}: {' '.join(problem.split())[:300]}")


def _check_strict(schema: Any, where: str, path: str) -> None:
    """OpenAI's strict structured outputs: closed objects whose properties are all required."""
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            raise validation_error(f"grammar is not valid: {where}: strict mode needs `additionalProperties: false` "
                                   f"at {path}")
        missing = [k for k in schema.get("properties", {}) if k not in schema.get("required", [])]
        if missing:
            raise validation_error(f"grammar is not valid: {where}: strict mode needs every property in `required` "
                                   f"at {path}; missing {', '.join(missing)}")
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            _check_strict(sub, where, f"{path}/{key}/{name}")
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key) or []):
            _check_strict(sub, where, f"{path}/{key}/{i}")
    if isinstance(schema.get("items"), dict):
        _check_strict(schema["items"], where, f"{path}/items")


def response_format_grammar(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` as a TGI grammar parameter (None: free text)."""
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "json", "value": response_format.get("value") or ANY_JSON_OBJECT}
    if kind == "json_schema":
        spec = response_format.get("value") or response_format.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise validation_error("`response_format.json_schema` must be an object with a `schema`")
        if "json_schema" in response_format and "schema" not in spec:  # OpenAI's wrapper, no schema
            return {"type": "json", "value": ANY_JSON_OBJECT}
        return {"type": "json_schema", "value": spec}  # grammar_fields tells a wrapper from a bare schema
    return dict(response_format)  # TGI's own shapes ("json", "regex") pass through to grammar_fields
