"""The published OpenAPI document, and the local stack fuzzed from it over HTTP.

Bodies are drawn from the document's request schemas (valid-looking events), then mutated (a field
set to any JSON value) or replaced by arbitrary JSON and bytes. Whatever is sent: no 5xx, every
4xx in the contract's error shape, every 2xx in the documented shape, and the table holds exactly
what the answers say was stored (nothing at all for a refused request).

Every strategy is bounded, in examples and in size, so that the run's time and memory are too: texts,
lists and dicts have a maximum size, and integers a range. Steps span the contract's whole range, up to
2**53 - 1: the server's work follows the events that exist, never a step's numeric value (issue 13
item 7; before that, one stored step near 2**53 grew a run of this module to 22.7 GB). Integers past
the range are a few the contract refuses (2**53, 2**63, 10**400...). ``test_openapi_schemathesis.py``
fuzzes the same document with schemathesis.
"""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from infra import openapi
from instantml import limits, routes

PROJECT = "fuzz"
DOCUMENT = json.loads(openapi.OPENAPI_JSON.read_text())
SCHEMAS = DOCUMENT["components"]["schemas"]
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: Integers the contract refuses in every integer field, however large.
REFUSED_INTEGERS = [-1, -(2**63), limits.MAX_STEP + 1, 2**63, 2**64, 10**400]
MAX_TEXT = 64


def test_openapi_json_is_what_the_code_generates_and_is_valid() -> None:
    from openapi_spec_validator import validate

    assert openapi.render() == openapi.OPENAPI_JSON.read_text(), "run: python -m infra.openapi"
    validate(DOCUMENT)
    documented = {path for path, ops in DOCUMENT["paths"].items() for _ in ops}
    assert documented == {v for k, v in vars(routes).items() if k.isupper()}


# ------------------------------------------------------------------ strategies from the document


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of the JSON Schema subset the document uses (refs, anyOf, enum, objects, patterns)."""
    if "$ref" in schema:
        return from_schema(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**63) - 1)
        return st.integers(schema.get("minimum"), high)
    if kind == "number":
        return st.floats(schema.get("minimum"), allow_nan=False, allow_infinity=False)
    if kind == "string":
        # A pattern's own quantifiers bound its strings (at most 256 characters here).
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(max_size=MAX_TEXT)
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema["items"]), min_size=schema.get("minItems", 0), max_size=4)
    assert kind == "object", schema
    if "patternProperties" in schema:
        ((pattern, values),) = schema["patternProperties"].items()
        return st.dictionaries(
            st.from_regex(pattern, fullmatch=True), from_schema(values), min_size=1, max_size=4
        )
    properties = schema["properties"]
    required = {k: from_schema(properties[k]) for k in schema.get("required", [])}
    optional = {k: from_schema(v) for k, v in properties.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional)


any_json: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), limits.MAX_STEP)
    | st.sampled_from(REFUSED_INTEGERS)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A drawn event with one field (existing or not) set to any JSON value, or removed."""
    event = dict(draw(base))
    field = draw(st.sampled_from([*SCHEMAS["RankEvent"]["properties"], "extra"]))
    if draw(st.booleans()):
        event.pop(field, None)
    else:
        event[field] = draw(any_json)
    return event


# A valid body is likelier with rank < world_size: bias half of the drawn events that way.
def _plausible(event: dict[str, Any]) -> dict[str, Any]:
    return {**event, "rank": event["rank"] % event["world_size"], "local_rank": None}


EVENT = from_schema(SCHEMAS["RankEvent"])
EVENTS = EVENT | EVENT.map(_plausible)
BODIES = st.one_of(
    EVENTS.map(json.dumps),
    mutated(EVENTS).map(json.dumps),
    any_json.map(json.dumps),
    st.binary(max_size=64),
)
ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8)
KEYS = st.none() | st.from_regex(limits.EVENT_ID_PATTERN, fullmatch=True) | ASCII


# ------------------------------------------------------------------------------------- helpers


def post(
    stack: Any, path: str, body: str | bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], Any]:
    url = urlsplit(stack.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        connection.request("POST", path, data, headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        return response.status, {k.lower(): v for k, v in response.getheaders()}, answer
    finally:
        connection.close()


def _resolved(name: str) -> dict[str, Any]:
    """A component schema with its refs pointing into the document, for jsonschema."""
    return {"$ref": f"#/components/schemas/{name}", "components": {"schemas": SCHEMAS}}


def stored_ids(stack: Any, run_id: str) -> list[str]:
    return [e.event_id for e in stack.store().read_events(PROJECT, run_id).events]


def headers_for(stack: Any, key: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


# ---------------------------------------------------------------------------------------- fuzz


@FUZZ
@given(body=BODIES, key=KEYS)
def test_fuzzed_single_events_never_5xx_and_store_exactly_what_they_answer(
    local_stack: Any, body: str | bytes, key: str | None
) -> None:
    run_id = uuid.uuid4().hex
    path = routes.RANK_METRICS.format(project=PROJECT, run_id=run_id)
    status, _, answer = post(local_stack, path, body, headers_for(local_stack, key))
    event(f"status {status}")
    jsonschema.validate(answer, _resolved("EventResult" if status < 400 else "Error"))
    assert status in (201, 400, 413, 422), answer
    assert stored_ids(local_stack, run_id) == ([answer["event_id"]] if status == 201 else [])


@st.composite
def batches(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.sampled_from(["events", "events", "events", "json", "bytes"]))
    if kind == "json":
        return json.dumps(draw(any_json | st.fixed_dictionaries({"events": any_json})))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    events = draw(st.lists(EVENTS | mutated(EVENTS), min_size=1, max_size=6))
    ids: list[str | None] = [f"e{i}" for i in range(len(events))]
    if draw(st.integers(0, 9)) == 0:  # sometimes a repeated, missing or bad id
        ids[-1] = draw(st.sampled_from([ids[0], "", "\x01", None]))
    return json.dumps(
        {"events": [{**e, "event_id": i} if i is not None else e for e, i in zip(events, ids, strict=True)]}
    )


@FUZZ
@given(body=batches())
def test_fuzzed_batches_never_5xx_and_store_exactly_what_they_answer(
    local_stack: Any, body: str | bytes
) -> None:
    run_id = uuid.uuid4().hex
    path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run_id)
    status, _, answer = post(local_stack, path, body, headers_for(local_stack))
    event(f"status {status}, stored {answer.get('stored')}")
    jsonschema.validate(answer, _resolved("BatchResult" if status < 400 else "Error"))
    assert status in (200, 400, 413), answer
    if status == 200:
        stored = [r["event_id"] for r in answer["results"] if r["status"] == "stored"]
        assert sorted(stored_ids(local_stack, run_id)) == sorted(stored)
        assert answer["stored"] == len(stored)
        assert all(
            r["error"]["code"] in {"invalid_request", "payload_too_large"}
            for r in answer["results"]
            if r["status"] == "rejected"
        )
    else:
        assert stored_ids(local_stack, run_id) == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "text/json"])
def test_a_body_that_is_not_sent_as_json_is_415_over_http(local_stack: Any, content_type: str) -> None:
    run_id = uuid.uuid4().hex
    body = json.dumps({"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}})
    headers = {**headers_for(local_stack, "k1"), "Content-Type": content_type}
    status, _, answer = post(
        local_stack, routes.RANK_METRICS.format(project=PROJECT, run_id=run_id), body, headers
    )
    assert (status, answer["error"]["code"]) == (415, "unsupported_media_type")
    assert stored_ids(local_stack, run_id) == []
