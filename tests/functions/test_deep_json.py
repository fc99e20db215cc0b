"""Deeply nested JSON bodies: a 400 in the contract's error shape naming ``body``, never a 500.

Thousands of ``[`` or ``{`` once escaped ``json.loads`` as a RecursionError (a 500). The real handlers
with real API Gateway v2 events here; ``test_deep_json_http.py`` sends the same bodies over HTTP.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from instantml import limits
from shared.errors import InvalidInput
from shared.ingest.json_body import MAX_JSON_DEPTH, parse_json
from tests.conftest import call, load_event, with_body

POST = "post_rank_metrics.json"
BATCH = "post_rank_metrics_batch.json"
GET = "get_distributed.json"


def nested(depth: int, inner: str = "1") -> str:
    """``depth`` levels of arrays and objects, alternating, around ``inner``."""
    opening = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opening + inner + closing


def event_with(field: str, value: str, event_id: str | None = None) -> str:
    head = f'"event_id":"{event_id}",' if event_id else ""
    return f'{{{head}"step":1,"rank":0,"world_size":1,"metrics":{{"a":1}},"{field}":{value}}}'


def deep_bodies(depth: int) -> dict[str, str]:
    """Bodies for both routes with the deep part at the top, in a known field, or in an unknown one."""
    return {
        "arrays": "[" * depth + "]" * depth,
        "objects": '{"a":' * depth + "1" + "}" * depth,
        "mixed": nested(depth),
        "unclosed": "[" * depth,
        "in metrics": event_with("metrics", '{"a":' + nested(depth) + "}"),
        "in an unknown field": event_with("x", nested(depth)),
        "in a batch event": '{"events":[' + event_with("x", nested(depth), "e1") + "]}",
        "in a batch's metrics": '{"events":['
        + event_with("metrics", '{"a":' + nested(depth) + "}", "e1")
        + "]}",
    }


def assert_refused_naming_body(status: int, answer: Any) -> None:
    assert status == 400, answer
    assert set(answer) == {"error"}, answer
    assert answer["error"]["code"] == "invalid_request"
    assert isinstance(answer["error"]["message"], str)
    assert answer["error"]["message"]
    assert [d["field"] for d in answer["error"]["details"]] == ["body"], answer


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 5_000, 30_000])
@pytest.mark.parametrize("sample", [POST, BATCH])
def test_a_deeply_nested_body_is_400_naming_body_and_stores_nothing(
    handlers: dict[str, Any], sample: str, depth: int
) -> None:
    ingest = handlers["IngestFunction"]
    for name, body in deep_bodies(depth).items():
        status, _, answer = call(ingest, with_body(load_event(sample), body))
        if sample == POST and len(body.encode()) > limits.MAX_EVENT_BYTES:
            assert (status, answer["error"]["code"]) == (413, "payload_too_large"), name
            continue
        assert_refused_naming_body(status, answer)
    assert call(handlers["SummarizeFunction"], load_event(GET))[0] == 404  # nothing was stored


def test_a_deeply_nested_base64_body_is_400_too(handlers: dict[str, Any]) -> None:
    event = with_body(load_event(BATCH), "")
    event["body"] = base64.b64encode(("[" * 10_000).encode()).decode()
    event["isBase64Encoded"] = True
    assert_refused_naming_body(*call(handlers["IngestFunction"], event)[::2])


def test_nesting_up_to_the_bound_is_still_judged_as_an_event(handlers: dict[str, Any]) -> None:
    """At the bound the body parses, and the answer is about the event's fields, not the nesting."""
    body = event_with("x", nested(MAX_JSON_DEPTH - 1))  # the event's object is the first level
    status, _, answer = call(handlers["IngestFunction"], with_body(load_event(POST), body))
    assert status == 400
    assert [d["field"] for d in answer["error"]["details"]] == ["x"], answer

    def batch(depth: int) -> str:  # the body, its events and the event take three levels
        return '{"events":[' + event_with("x", nested(depth), "e1") + "]}"

    status, _, answer = call(
        handlers["IngestFunction"], with_body(load_event(BATCH), batch(MAX_JSON_DEPTH - 3))
    )
    assert (status, answer["rejected"], answer["results"][0]["status"]) == (200, 1, "rejected")
    assert_refused_naming_body(
        *call(handlers["IngestFunction"], with_body(load_event(BATCH), batch(MAX_JSON_DEPTH - 2)))[::2]
    )


def test_valid_events_still_pass_beside_the_check(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    assert call(ingest, load_event(POST))[0] == 201
    status, _, answer = call(ingest, load_event(BATCH))
    assert (status, answer["rejected"]) == (200, 0)


# ------------------------------------------------------------------------------ parse_json itself


@pytest.mark.parametrize("as_bytes", [False, True])
def test_parse_json_takes_the_bound_and_refuses_one_more_level(as_bytes: bool) -> None:
    def parse(text: str) -> Any:
        return parse_json(text.encode() if as_bytes else text)

    assert parse(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(InvalidInput) as refused:
            parse(nested(depth))
        assert [d.field for d in refused.value.details] == ["body"]
    # Many brackets side by side are wide, not deep.
    wide = json.dumps([[[i]] for i in range(10_000)])
    assert parse(wide) == json.loads(wide)
