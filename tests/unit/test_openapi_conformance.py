"""The server answers what /openapi.json says it answers: a bounded property-based run over every
operation of the document, through the real app and router driver over a stub shard
(tests/unit/test_api_validation_limits.py).

Each example picks an operation and sends either a body generated from its request schema, any JSON
value, or bytes that are mostly not JSON. It fails on any 5xx, on a status the operation does not
document, on a content type the document does not give for that status, on a body where the document
promises none, and on a JSON body its documented schema rejects (jsonschema)."""

from __future__ import annotations

import asyncio
import functools
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_api_validation_limits import serving

MAX_TOKENS_KEYS = {"max_new_tokens", "max_tokens", "max_completion_tokens"}
EXAMPLES = 150  # about 6 s here; raise it locally for a longer hunt


class Server:
    """The app served on one event loop for the whole module (hypothesis calls in synchronously)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._serving = serving(True, max_input=200, max_total=256, arch="qwen2_vl")
        self.client, self.shard = self.loop.run_until_complete(self._serving.__aenter__())
        self.document = self.call("GET", "/openapi.json").json()

    def call(self, method: str, path: str, **kwargs):
        return self.loop.run_until_complete(self.client.request(method, path, timeout=30, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self._serving.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def self_contained(schema: dict, document: dict) -> dict:
    """`schema` with the document's components as `$defs` (what jsonschema and hypothesis resolve)."""
    text = json.dumps(schema).replace("#/components/schemas/", "#/$defs/")
    return {**json.loads(text), "$defs": json.loads(json.dumps(document["components"]["schemas"]).replace(
        "#/components/schemas/", "#/$defs/"))}


@functools.lru_cache(maxsize=64)
def validator(schema: str, components: str) -> jsonschema.Draft202012Validator:
    """A checked validator per documented schema (jsonschema.validate re-checks the schema every call)."""
    whole = self_contained(json.loads(schema), {"components": json.loads(components)})
    jsonschema.Draft202012Validator.check_schema(whole)
    return jsonschema.Draft202012Validator(whole)


def operations(document: dict) -> list[tuple[str, str, dict]]:
    return [(method.upper(), path, op) for path, ops in document["paths"].items() for method, op in ops.items()]


def bounded(value):
    """Generated token budgets capped at 8, to bound the run's time (other values stay as generated)."""
    if isinstance(value, dict):
        return {k: (min(v, 8) if k in MAX_TOKENS_KEYS and isinstance(v, int) and v > 8 else bounded(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [bounded(v) for v in value]
    return value


FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | FLOATS | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values shaped by a JSON Schema, mostly valid: the keywords pydantic writes ($ref, anyOf, type,
    enum/const, properties/required, items, bounds), optional properties in or out at random."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth + 1))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs, depth) for s in schema[key]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return _object(schema, defs, depth)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1) if depth < 10 else JSON
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    simple = {"string": st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30)),
              "integer": st.integers(schema.get("minimum", -(2**65)), schema.get("maximum", 2**65)),
              "number": st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False),
              "boolean": st.booleans(), "null": st.none()}
    return simple.get(kind, JSON)


def _object(schema: dict, defs: dict, depth: int) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    fields = {k: from_schema(v, defs, depth + 1) if depth < 10 else JSON for k, v in properties.items()}
    optional = [k for k in properties if k not in required]
    return st.tuples(st.fixed_dictionaries({k: fields[k] for k in required}),
                     st.fixed_dictionaries({}, optional={k: fields[k] for k in optional})).map(
        lambda parts: {**parts[0], **parts[1]})


def requests_for(document: dict) -> st.SearchStrategy:
    def for_operation(operation):
        method, path, op = operation
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if body is None:
            return st.just((method, path, None))
        defs = document["components"]["schemas"]
        kinds = st.one_of(from_schema(body, defs).map(bounded), JSON.map(bounded),
                          st.binary(max_size=40).map(lambda b: b"\x00raw" + b))
        return kinds.map(lambda b: (method, path, b))

    return st.sampled_from(operations(document)).flatmap(for_operation)


def check_answer(document: dict, method: str, path: str, response) -> None:
    where = f"{method} {path} -> {response.status_code}"
    assert response.status_code < 500, f"{where}: {response.text[:300]}"
    documented = document["paths"][path][method.lower()]["responses"]
    assert str(response.status_code) in documented, f"{where} is not documented: {response.text[:300]}"
    content = documented[str(response.status_code)].get("content")
    if not content:
        assert response.content == b"", f"{where}: the document promises no body"
        return
    media = response.headers.get("content-type", "").split(";")[0]
    assert media in content, f"{where}: {media!r} not in {list(content)}"
    if media == "application/json":
        schema = content[media].get("schema")
        assert schema, f"{where}: JSON without a documented schema"
        validator(json.dumps(schema), json.dumps(document["components"])).validate(response.json())


def test_the_document_lists_every_route_with_its_answers(server):
    paths = {(m, p) for m, p, _ in operations(server.document)}
    assert paths == {("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"), ("GET", "/"),
                     ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                     ("GET", "/info"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics"), ("POST", "/tokenize")}
    chat = server.document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(chat) == {"200", "400", "401", "413", "422", "424", "429", "500"}
    assert "content" not in server.document["paths"]["/health"]["get"]["responses"]["200"]
    assert set(server.document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_a_body_that_is_not_json_is_a_documented_400(server):
    response = server.call("POST", "/v1/chat/completions", content=b'{"messages": [',
                           headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"].startswith(
        "Failed to parse the request body as JSON: ")
    check_answer(server.document, "POST", "/v1/chat/completions", response)


def test_every_answer_is_one_the_document_describes(server):
    document = server.document

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(requests_for(document))
    def answer_matches(request):
        method, path, body = request
        if body is None:
            response = server.call(method, path)
        elif isinstance(body, bytes):
            response = server.call(method, path, content=body, headers={"content-type": "application/json"})
        else:
            response = server.call(method, path, json=body)
        check_answer(document, method, path, response)

    answer_matches()
