"""The real handlers with real API Gateway HTTP API (payload 2.0) events, against moto."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import call, load_event, with_body

POST = "post_rank_metrics.json"
BATCH = "post_rank_metrics_batch.json"
GET = "get_distributed.json"


def test_an_event_is_stored_then_a_replay_is_a_duplicate(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    status, _, body = call(ingest, load_event(POST))
    assert (status, body) == (201, {"event_id": "sample-event-0001", "status": "stored"})

    status, headers, body = call(ingest, load_event(POST))
    assert (status, body["status"]) == (200, "duplicate")
    assert headers["idempotent-replayed"] == "true"

    status, _, summary = call(handlers["SummarizeFunction"], load_event(GET))
    assert status == 200
    assert summary["reducers"]["train/loss"]["count"] == [1]  # counted once


def test_a_reused_event_id_with_another_payload_is_422_and_changes_nothing(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    call(ingest, load_event(POST))
    other = with_body(
        load_event(POST), {"step": 100, "rank": 0, "world_size": 8, "metrics": {"train/loss": 9.0}}
    )
    status, _, body = call(ingest, other)
    assert status == 422
    assert body["error"]["code"] == "idempotency_key_reused"
    _, _, summary = call(handlers["SummarizeFunction"], load_event(GET))
    assert summary["reducers"]["train/loss"]["mean"] == [0.12]


def test_a_quoted_idempotency_key_is_the_same_event(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    call(ingest, load_event(POST))
    status, _, body = call(
        ingest, with_body(load_event(POST), load_event(POST)["body"], idempotency_key='"sample-event-0001"')
    )
    assert (status, body["status"]) == (200, "duplicate")


def test_bad_input_is_400_in_the_contract_shape_naming_the_field(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    cases = {
        "rank": {"step": 1, "rank": 8, "world_size": 8, "metrics": {"a": 1}},
        "world_size": {"step": 1, "rank": 0, "world_size": 513, "metrics": {"a": 1}},
        "step": {"step": -1, "rank": 0, "world_size": 8, "metrics": {"a": 1}},
        "metrics.a": {"step": 1, "rank": 0, "world_size": 8, "metrics": {"a": True}},
        "metrics": {"step": 1, "rank": 0, "world_size": 8, "metrics": {}},
    }
    for i, (field, body) in enumerate(cases.items()):
        event = with_body(load_event(POST), body, idempotency_key=f"bad-{i}")
        status, _, response = call(ingest, event)
        assert status == 400, (field, response)
        assert response["error"]["code"] == "invalid_request"
        assert any(d["field"].startswith(field) for d in response["error"]["details"]), (field, response)
    status, _, response = call(ingest, with_body(load_event(POST), "not json", idempotency_key="bad-json"))
    assert status == 400
    assert response["error"]["code"] == "invalid_request"
    assert call(handlers["SummarizeFunction"], load_event(GET))[0] == 404  # nothing was stored


def test_nonfinite_values_are_kept_and_counted(handlers: dict[str, Any]) -> None:
    body = {"step": 3, "rank": 1, "world_size": 2, "metrics": {"train/loss": "NaN"}}
    assert (
        call(handlers["IngestFunction"], with_body(load_event(POST), body, idempotency_key="nan-1"))[0] == 201
    )
    body = {"step": 3, "rank": 0, "world_size": 2, "metrics": {"train/loss": 1.5}}
    assert (
        call(handlers["IngestFunction"], with_body(load_event(POST), body, idempotency_key="ok-1"))[0] == 201
    )
    _, _, summary = call(handlers["SummarizeFunction"], load_event(GET))
    loss = summary["reducers"]["train/loss"]
    assert (loss["count"], loss["nonfinite"], loss["mean"]) == ([1], [1], [1.5])
    assert [f["kind"] for f in summary["findings"]] == ["nonfinite"]


def test_batch_stores_each_event_and_rejects_a_bad_one_without_stopping(handlers: dict[str, Any]) -> None:
    events = [
        {
            "event_id": "b1",
            "step": 0,
            "rank": 0,
            "world_size": 2,
            "metrics": {"train/loss": 1.0},
            "weight": 3,
        },
        {"event_id": "b2", "step": 0, "rank": 5, "world_size": 2, "metrics": {"train/loss": 2.0}},
        {
            "event_id": "b3",
            "step": 0,
            "rank": 1,
            "world_size": 2,
            "metrics": {"train/loss": 2.0},
            "weight": 1,
        },
    ]
    status, _, body = call(handlers["IngestFunction"], with_body(load_event(BATCH), {"events": events}))
    assert status == 200
    assert [r["status"] for r in body["results"]] == ["stored", "rejected", "stored"]
    assert body["results"][1]["error"]["code"] == "invalid_request"
    assert (body["stored"], body["duplicate"], body["rejected"]) == (2, 0, 1)
    _, _, summary = call(handlers["SummarizeFunction"], load_event(GET))
    assert summary["reducers"]["train/loss"]["weighted_mean"] == [1.25]


def test_a_batch_event_without_an_id_rejects_the_whole_request(handlers: dict[str, Any]) -> None:
    events = [{"step": 0, "rank": 0, "world_size": 1, "metrics": {"x": 1.0}}]
    status, _, body = call(handlers["IngestFunction"], with_body(load_event(BATCH), {"events": events}))
    assert status == 400
    assert body["error"]["details"][0]["field"] == "events.0.event_id"


def test_the_page_shell_needs_no_token_and_carries_no_data(handlers: dict[str, Any]) -> None:
    status, headers, page = call(handlers["SummarizeFunction"], load_event("get_distributed_view.json"))
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert "<canvas" in page
    assert "localStorage" in page
    assert "distributed-job" not in page  # nothing of the run is in the shell


def test_unknown_route_and_bad_query_are_contract_errors(handlers: dict[str, Any]) -> None:
    event = load_event(GET)
    event["rawPath"] = event["requestContext"]["http"]["path"] = "/v1/nothing"
    status, _, body = call(handlers["SummarizeFunction"], event)
    assert (status, body["error"]["code"]) == (404, "not_found")
    event = load_event(GET)
    event["queryStringParameters"] = {"max_steps": "zero"}
    status, _, body = call(handlers["SummarizeFunction"], event)
    assert status == 400
    assert body["error"]["details"][0]["field"] == "max_steps"


def test_bad_summary_parameters_are_400s_naming_each_field(handlers: dict[str, Any]) -> None:
    event = load_event(GET)
    event["queryStringParameters"] = {
        "outlier_method": "iqr",
        "outlier_threshold": "-1",
        "outlier_limit": "x",
        "step_min": "9",
        "step_max": "3",
        "colour": "red",
    }
    status, _, body = call(handlers["SummarizeFunction"], event)
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    fields = {d["field"] for d in body["error"]["details"]}
    assert fields == {"outlier_method", "outlier_threshold", "outlier_limit", "step_min", "colour"}


def test_the_summary_is_gzipped_for_clients_that_accept_it(handlers: dict[str, Any]) -> None:
    import base64
    import gzip
    import json

    from tests.conftest import Context

    assert call(handlers["IngestFunction"], load_event(POST))[0] == 201
    event = load_event(GET)
    event["headers"]["accept-encoding"] = "gzip, deflate"
    response = handlers["SummarizeFunction"](event, Context())
    assert response["statusCode"] == 200
    assert response["isBase64Encoded"]
    assert response["headers"]["Content-Encoding"] == "gzip"
    summary = json.loads(gzip.decompress(base64.b64decode(response["body"])))
    assert summary["reducers"]["train/loss"]["count"] == [1]


@pytest.mark.slow
def test_a_summary_too_large_for_a_lambda_response_is_a_400_saying_what_to_ask_for(
    handlers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64
    import gzip
    import sys

    from tests.conftest import Context

    assert call(handlers["IngestFunction"], load_event(BATCH))[0] == 200
    plain = handlers["SummarizeFunction"](load_event(GET), Context())
    assert plain["statusCode"] == 200
    assert "Content-Encoding" not in plain["headers"]
    size = len(plain["body"].encode())
    event = load_event(GET)
    event["headers"]["accept-encoding"] = "gzip"
    zipped = handlers["SummarizeFunction"](event, Context())
    assert len(gzip.decompress(base64.b64decode(zipped["body"]))) == size

    # The real limit is 6 MB (512 ranks x 200 steps x 3 keys is 8 MB of JSON); lowered to this body.
    monkeypatch.setattr(sys.modules["functions.summarize.app"], "MAX_BODY_BYTES", size - 1)
    status, _, body = call(handlers["SummarizeFunction"], load_event(GET))
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    assert body["error"]["details"][0]["field"] == "max_steps"
    assert (
        "send Accept-Encoding: gzip, or ask for fewer columns (max_steps is 200)" in body["error"]["message"]
    )
    assert handlers["SummarizeFunction"](event, Context())["statusCode"] == 200  # gzipped, it fits


def test_a_refresh_with_since_moves_what_changed_and_a_bad_since_is_a_400(
    handlers: dict[str, Any],
) -> None:
    assert call(handlers["IngestFunction"], load_event(POST))[0] == 201
    event = load_event(GET)
    event["queryStringParameters"] = {"heatmap": "base64"}
    status, _, first = call(handlers["SummarizeFunction"], event)
    assert status == 200
    assert first["heatmap_encoding"] == "base64"
    assert isinstance(first["version"], str)
    event["queryStringParameters"]["since"] = first["version"]
    assert call(handlers["SummarizeFunction"], event)[2] == {"version": first["version"], "unchanged": True}

    body = {**json.loads(load_event(POST)["body"]), "step": 101}
    later = with_body(load_event(POST), body, idempotency_key="e2")
    assert call(handlers["IngestFunction"], later)[0] == 201
    status, _, delta = call(handlers["SummarizeFunction"], event)
    assert status == 200
    assert delta["since"] == first["version"]
    assert delta["from_column"] == 1
    assert delta["steps"] == [101]
    assert delta["version"] != first["version"]

    event["queryStringParameters"] = {"since": "not a version!", "heatmap": "bars"}
    status, _, body = call(handlers["SummarizeFunction"], event)
    assert status == 400
    assert {d["field"] for d in body["error"]["details"]} == {"since", "heatmap"}
