"""The ingest function's contract: bad input, store faults, ordering rules and observability.

Real handlers with real API Gateway HTTP API events against moto. moto cannot throttle or time out,
so store faults come from a client that wraps the real one and fails chosen calls.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from tests.conftest import TOKEN, call, load_event, with_body

POST = "post_rank_metrics.json"
BATCH = "post_rank_metrics_batch.json"
GET = "get_distributed.json"


def event(i: int = 0, **fields: Any) -> dict[str, Any]:
    body = {"step": 1, "rank": i % 8, "world_size": 8, "metrics": {"train/loss": 1.0 + i}}
    body.update(fields)
    return body


def nothing_stored(handlers: dict[str, Any]) -> bool:
    return call(handlers["SummarizeFunction"], load_event(GET))[0] == 404


def stored_events(handlers: dict[str, Any]) -> list[Any]:
    """Every item of the sample run, read straight from the table (duplicates would show here)."""
    events: list[Any] = (
        sys.modules["functions.ingest.app"].store().read_events("distributed-job", "r1").events
    )
    return events


# ------------------------------------------------------------------------------------- bad input

KEYS_257 = {f"k{i}": 1.0 for i in range(257)}
BIG = {f"k{i:03d}-" + "x" * 250: 1.0 for i in range(256)}  # 256 keys of 255 chars: 66 KiB

SINGLE_CASES: list[tuple[str, Any, dict[str, str], int, str]] = [
    # name, body (object or raw text), extra headers, status, the field the error must name
    ("not json", "step=1", {}, 400, "body"),
    ("a json array", "[]", {}, 400, "body"),
    ("a json string", '"event"', {}, 400, "body"),
    ("empty body", "", {}, 400, "body"),
    ("missing fields", {"metrics": {"a": 1.0}}, {}, 400, "step"),
    ("boolean step", event(step=True), {}, 400, "step"),
    ("boolean metric", event(metrics={"a": False}), {}, 400, "metrics.a"),
    ("1e309", '{"step": 1, "rank": 0, "world_size": 8, "metrics": {"a": 1e309}}', {}, 400, "metrics.a"),
    ("NaN literal", '{"step": 1, "rank": 0, "world_size": 8, "metrics": {"a": NaN}}', {}, 400, "body"),
    ("step as string", event(step="1"), {}, 400, "step"),
    ("metric as string", event(metrics={"a": "1.5"}), {}, 400, "metrics.a"),
    ("rank == world_size", event(rank=8), {}, 400, "rank"),
    ("local_rank == world_size", event(local_rank=8), {}, 400, "local_rank"),
    ("world_size 0", event(world_size=0, rank=0), {}, 400, "world_size"),
    ("world_size 513", event(world_size=513), {}, 400, "world_size"),
    ("negative step", event(step=-1), {}, 400, "step"),
    ("step 2^53", event(step=2**53), {}, 400, "step"),
    ("negative weight", event(weight=-1), {}, 400, "weight"),
    ("infinite weight", event(weight="Infinity"), {}, 400, "weight"),
    ("257 keys", event(metrics=KEYS_257), {}, 400, "metrics"),
    ("300-char key", event(metrics={"k" * 300: 1.0}), {}, 400, "metrics"),
    ("control character in a key", event(metrics={"a\x07b": 1.0}), {}, 400, "metrics"),
    ("misspelt field", event(stepp=3), {}, 400, "stepp"),
    ("65 KiB event", event(metrics=BIG), {}, 413, "body"),
    ("wrong content type", event(), {"content_type": "text/plain"}, 415, "Content-Type"),
    (
        "form content type",
        event(),
        {"content_type": "application/x-www-form-urlencoded"},
        415,
        "Content-Type",
    ),
    ("body id differs from header", event(event_id="other"), {}, 400, "event_id"),
    ("bad Idempotency-Key", event(), {"idempotency_key": "k" * 256}, 400, "Idempotency-Key"),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "field"),
    [case[1:] for case in SINGLE_CASES],
    ids=[case[0] for case in SINGLE_CASES],
)
def test_bad_single_event_is_4xx_naming_the_field_and_stores_nothing(
    handlers: dict[str, Any], body: Any, headers: dict[str, str], status: int, field: str
) -> None:
    got, _, response = call(handlers["IngestFunction"], with_body(load_event(POST), body, **headers))
    assert got == status, response
    assert set(response) == {"error"}
    assert set(response["error"]) == {"code", "message", "details"}
    assert response["error"]["code"] == {400: "invalid_request", 413: "payload_too_large"}.get(
        status, "unsupported_media_type"
    )
    assert any(d["field"].startswith(field) for d in response["error"]["details"]), response
    assert nothing_stored(handlers)


def test_a_body_that_is_not_utf8_is_400_not_500(handlers: dict[str, Any]) -> None:
    import base64

    for sample in (POST, BATCH):
        request = load_event(sample)
        request["body"] = base64.b64encode(b'{"step": 1, "metrics": {"\xff\xfe": 1}}').decode()
        request["isBase64Encoded"] = True
        status, _, response = call(handlers["IngestFunction"], request)
        assert (status, response["error"]["details"][0]["field"]) == (400, "body")
    assert nothing_stored(handlers)


def batch_of(n: int, **fields: Any) -> dict[str, Any]:
    return {"events": [{"event_id": f"e{i}", **event(i, **fields)} for i in range(n)]}


BATCH_CASES: list[tuple[str, Any, dict[str, str], int, str]] = [
    ("not json", "{events", {}, 400, "body"),
    ("a json array", json.dumps([event()]), {}, 400, "events"),
    ("no events", {"events": []}, {}, 400, "events"),
    ("1001 events", batch_of(1001), {}, 400, "events"),
    ("6 MiB batch", {"events": [], "pad": "x" * (6 * 1024 * 1024)}, {}, 413, "body"),
    ("missing event_id", {"events": [event()]}, {}, 400, "events.0.event_id"),
    ("an event that is not an object", {"events": [5]}, {}, 400, "events.0.event_id"),
    (
        "duplicate event_id",
        {"events": [{"event_id": "x", **event(0)}, {"event_id": "x", **event(1)}]},
        {},
        400,
        "events.1.event_id",
    ),
    ("wrong content type", batch_of(2), {"content_type": "text/csv"}, 415, "Content-Type"),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "field"),
    [case[1:] for case in BATCH_CASES],
    ids=[case[0] for case in BATCH_CASES],
)
def test_bad_batch_is_refused_whole_and_stores_nothing(
    handlers: dict[str, Any], body: Any, headers: dict[str, str], status: int, field: str
) -> None:
    got, _, response = call(handlers["IngestFunction"], with_body(load_event(BATCH), body, **headers))
    assert got == status, response
    assert any(d["field"] == field for d in response["error"]["details"]), response
    assert nothing_stored(handlers)


def test_a_bad_event_in_a_batch_is_rejected_and_the_others_stored(handlers: dict[str, Any]) -> None:
    events = batch_of(5)["events"]
    events[1]["metrics"] = BIG  # over 64 KiB on its own
    events[3]["rank"] = 8
    status, _, body = call(handlers["IngestFunction"], with_body(load_event(BATCH), {"events": events}))
    assert status == 200
    assert [r["status"] for r in body["results"]] == ["stored", "rejected", "stored", "rejected", "stored"]
    assert [r["event_id"] for r in body["results"]] == ["e0", "e1", "e2", "e3", "e4"]
    assert body["results"][1]["error"]["code"] == "payload_too_large"
    assert body["results"][3]["error"]["details"][0]["field"] == "rank"
    assert sorted(e.event_id for e in stored_events(handlers)) == ["e0", "e2", "e4"]


@pytest.mark.slow
def test_a_full_batch_of_1000_is_stored_once_and_replays_as_duplicates(handlers: dict[str, Any]) -> None:
    batch = {"events": [{"event_id": f"e{i}", **event(i, step=i // 8)} for i in range(1000)]}
    status, _, body = call(handlers["IngestFunction"], with_body(load_event(BATCH), batch))
    assert (status, body["stored"], body["duplicate"], body["rejected"]) == (200, 1000, 0, 0)
    assert [r["event_id"] for r in body["results"]] == [f"e{i}" for i in range(1000)]
    batch["events"][7]["metrics"] = {"train/loss": -1.0}  # the same id, another payload
    status, _, body = call(handlers["IngestFunction"], with_body(load_event(BATCH), batch))
    assert (status, body["stored"], body["duplicate"], body["rejected"]) == (200, 0, 999, 1)
    assert body["results"][7]["error"]["code"] == "idempotency_key_reused"
    assert len(stored_events(handlers)) == 1000


def test_the_later_time_wins_and_late_steps_are_kept(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    later = event(0, step=5, time=2000.0, metrics={"train/loss": 9.0})
    earlier = event(0, step=5, time=1000.0, metrics={"train/loss": 1.0})
    late_step = event(0, step=2, time=3000.0, metrics={"train/loss": 4.0})
    for i, body in enumerate((later, earlier, late_step)):
        assert call(ingest, with_body(load_event(POST), body, idempotency_key=f"t{i}"))[0] == 201
    _, _, summary = call(handlers["SummarizeFunction"], load_event(GET))
    assert summary["steps"] == [2, 5]
    assert summary["reducers"]["train/loss"]["count"] == [1, 1]
    assert summary["reducers"]["train/loss"]["mean"] == [4.0, 9.0]


def test_a_body_event_id_is_used_and_a_missing_one_is_assigned(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    plain = with_body(load_event(POST), event(event_id="from-body"))
    plain["headers"].pop("idempotency-key", None)
    status, _, body = call(ingest, plain)
    assert (status, body["event_id"]) == (201, "from-body")
    anonymous = with_body(load_event(POST), event(3))
    anonymous["headers"].pop("idempotency-key", None)
    status, _, body = call(ingest, anonymous)
    assert status == 201
    assert body["event_id"].startswith("srv-")


# ------------------------------------------------------------------------------------ store faults


class FaultyClient:
    """The real DynamoDB client, except that chosen ``put_item`` calls fail.

    ``faults`` maps a call number (0-based) to an exception; with ``after_write`` the put happens
    first and then the answer is lost (a timeout after DynamoDB stored the item).
    """

    def __init__(self, real: Any, faults: dict[int, Exception], after_write: bool = False) -> None:
        self._real, self._faults, self._after_write = real, faults, after_write
        self._lock = threading.Lock()
        self.calls = 0

    def put_item(self, **kwargs: Any) -> Any:
        with self._lock:
            n, self.calls = self.calls, self.calls + 1
        fault = self._faults.get(n)
        if fault is not None and not self._after_write:
            raise fault
        result = self._real.put_item(**kwargs)
        if fault is not None:
            raise fault
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, "PutItem")


def inject(faults: dict[int, Exception], after_write: bool = False) -> FaultyClient:
    store = sys.modules["functions.ingest.app"].store()
    faulty = FaultyClient(store.client, faults, after_write)
    store._client = faulty
    return faulty


def heal() -> None:
    store = sys.modules["functions.ingest.app"].store()
    store._client = store._client._real


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (client_error("ProvisionedThroughputExceededException"), 429, "rate_limited"),
        (client_error("ThrottlingException"), 429, "rate_limited"),
        (client_error("InternalServerError"), 503, "unavailable"),
        (ReadTimeoutError(endpoint_url="http://dynamodb"), 503, "unavailable"),
    ],
)
def test_store_faults_on_the_single_route_are_retryable_with_retry_after(
    handlers: dict[str, Any], fault: Exception, status: int, code: str
) -> None:
    ingest = handlers["IngestFunction"]
    inject({0: fault})
    got, headers, body = call(ingest, load_event(POST))
    assert (got, body["error"]["code"]) == (status, code)
    assert int(headers["retry-after"]) >= 1
    assert nothing_stored(handlers)
    got, _, body = call(ingest, load_event(POST))  # the client's retry
    assert (got, body["status"]) == (201, "stored")


def test_a_timeout_after_the_write_then_a_retry_counts_the_event_once(handlers: dict[str, Any]) -> None:
    ingest = handlers["IngestFunction"]
    inject({0: ReadTimeoutError(endpoint_url="http://dynamodb")}, after_write=True)
    assert call(ingest, load_event(POST))[0] == 503
    status, headers, body = call(ingest, load_event(POST))
    assert (status, body["status"], headers["idempotent-replayed"]) == (200, "duplicate", "true")
    assert len(stored_events(handlers)) == 1


class FailingRunNotes:
    """The real DynamoDB client, except that ``update_item`` (the runs table's) fails while ``failing``."""

    def __init__(self, real: Any, fault: Exception) -> None:
        self._real, self._fault = real, fault
        self.failing = True
        self.refused = 0

    def update_item(self, **kwargs: Any) -> Any:
        if self.failing:
            self.refused += 1
            raise self._fault
        return self._real.update_item(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", [client_error("ProvisionedThroughputExceededException"), client_error("InternalServerError")]
)
def test_a_stored_batch_is_never_refused_because_its_run_could_not_be_noted(
    handlers: dict[str, Any], fault: Exception
) -> None:
    """The events are stored: answering 429/503 for the run's record would only make the client send
    them again. The note waits for the run's next batch, which brings the record up to date."""
    ingest = handlers["IngestFunction"]
    store = sys.modules["functions.ingest.app"].store()
    failing = FailingRunNotes(store.client, fault)
    store._client = failing
    first = {"events": [{"event_id": f"a{i}", **event(i, step=3)} for i in range(8)]}
    got, _, body = call(ingest, with_body(load_event(BATCH), first))
    assert (got, body["stored"], failing.refused) == (200, 8, 1)
    assert len(stored_events(handlers)) == 8
    assert store.get_run("distributed-job", "r1") is None  # not noted yet

    failing.failing = False
    late = {"events": [{"event_id": "b0", **event(0, step=2)}]}  # an older step: only its time is new
    assert call(ingest, with_body(load_event(BATCH), late))[0] == 200
    record = store.get_run("distributed-job", "r1")
    assert record is not None
    assert (record.last_step, record.ranks_reporting, record.world_size) == (3, 8, 8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "status"),
    [
        (client_error("ProvisionedThroughputExceededException"), 429),
        (client_error("InternalServerError"), 503),
        (ReadTimeoutError(endpoint_url="http://dynamodb"), 503),
    ],
)
def test_a_store_fault_mid_batch_fails_the_batch_and_its_retry_stores_each_event_once(
    handlers: dict[str, Any], fault: Exception, status: int
) -> None:
    ingest = handlers["IngestFunction"]
    batch = {"events": [{"event_id": f"e{i}", **event(i, step=i // 8)} for i in range(200)]}
    faulty = inject({60: fault, 61: fault}, after_write=isinstance(fault, ReadTimeoutError))
    got, headers, body = call(ingest, with_body(load_event(BATCH), batch))
    assert (got, body["error"]["code"]) == (status, "rate_limited" if status == 429 else "unavailable")
    assert int(headers["retry-after"]) >= 1
    assert faulty.calls < 200  # no new puts started once the batch had failed
    written = {e.event_id for e in stored_events(handlers)}
    assert 0 < len(written) < 200

    heal()
    got, _, body = call(ingest, with_body(load_event(BATCH), batch))
    assert (got, body["rejected"], body["stored"] + body["duplicate"]) == (200, 0, 200)
    assert body["duplicate"] == len(written)
    assert sorted(e.event_id for e in stored_events(handlers)) == sorted(f"e{i}" for i in range(200))


# ---------------------------------------------------------------------------------- observability


def test_each_request_emits_emf_metrics_per_route(
    handlers: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    ingest = handlers["IngestFunction"]
    call(ingest, load_event(POST))
    call(ingest, load_event(POST))
    events = batch_of(3)["events"]
    events[2]["rank"] = 99
    call(ingest, with_body(load_event(BATCH), {"events": events}))
    call(ingest, with_body(load_event(BATCH), "nope"))
    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]
    seen = [
        (d["route"], *(sum(d[name]) for name in ("EventsStored", "EventsDuplicate", "EventsRejected")))
        for d in documents
    ]
    assert seen == [
        ("rank-metrics", 1, 0, 0),
        ("rank-metrics", 0, 1, 0),
        ("rank-metrics/batch", 2, 0, 1),
        ("rank-metrics/batch", 0, 0, 1),
    ]
    directive = documents[0]["_aws"]["CloudWatchMetrics"][0]
    assert directive["Namespace"] == "InstantML"
    assert all("route" in dimensions for dimensions in directive["Dimensions"])


def test_logs_carry_a_correlation_id_and_never_the_token_or_the_body(
    handlers: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import logging

    from functions.api import logger

    records: list[str] = []
    handler = logging.StreamHandler(type("Sink", (), {"write": records.append, "flush": lambda: None})())
    handler.setFormatter(logger.registered_formatter)
    logger.addHandler(handler)
    try:
        ingest = handlers["IngestFunction"]
        request = load_event(POST)
        request["requestContext"]["requestId"] = "corr-123"
        call(ingest, request)
        bad = with_body(load_event(POST), event(rank=99, metrics={"secret/metric-name": 1.0}))
        bad["requestContext"]["requestId"] = "corr-456"
        call(ingest, bad)
    finally:
        logging.getLogger(logger.name).removeHandler(handler)  # Powertools' Logger adds, never removes
    lines = [json.loads(r) for r in records if r.strip()]
    assert [(line["correlation_id"], line["message"]) for line in lines] == [
        ("corr-123", "rank event"),
        ("corr-456", "request refused"),
    ]
    assert lines[1]["fields"] == ["rank"]
    text = "".join(records)
    assert TOKEN not in text
    assert "train/loss" not in text
    assert "secret/metric-name" not in text


def test_a_typical_event_is_one_write_unit_and_keeps_nonfinite_values() -> None:
    import numpy as np

    from shared.ingest.bodies import validate_body
    from shared.ingest.parse import to_event
    from shared.store.dynamodb import item_of, write_units

    typical = event(3, local_rank=3, weight=1024, metrics={f"group/metric-{i:02d}": 1.5 for i in range(30)})
    item = item_of(to_event("distributed-job", "r1", validate_body(typical), "a" * 32, 0.0))
    assert write_units(item) == 1
    odd = event(0, metrics={"a": "NaN", "b": "-Infinity", "c": 0.1 + 0.2})
    packed = item_of(to_event("p", "r", validate_body(odd), "x", 5.0))["v"]["B"]
    values = np.frombuffer(packed, "<f8")
    assert np.isnan(values[2])
    assert values[3] == -np.inf
    assert values[4] == 0.1 + 0.2
    assert values[:2].tolist() == [1.0, 5.0]  # weight, time


class FailingPaginator:
    def __init__(self, fault: Exception) -> None:
        self.fault = fault

    def paginate(self, **kwargs: Any) -> Any:
        raise self.fault


@pytest.mark.parametrize(
    ("fault", "status"),
    [(client_error("ThrottlingException"), 429), (ReadTimeoutError(endpoint_url="http://dynamodb"), 503)],
)
def test_a_store_fault_while_summarizing_is_retryable_not_a_crash(
    handlers: dict[str, Any], fault: Exception, status: int
) -> None:
    call(handlers["IngestFunction"], load_event(POST))
    summarize = handlers["SummarizeFunction"]
    store = sys.modules["functions.summarize.app"].store()
    real = store.client

    def get_item(self: Any, **kwargs: Any) -> Any:
        raise fault

    faulty = {"get_paginator": lambda self, name: FailingPaginator(fault), "get_item": get_item}
    store._client = type("Faulty", (), faulty)()
    try:
        got, headers, body = call(summarize, load_event("get_distributed.json"))
    finally:
        store._client = real
    assert got == status
    assert int(headers["retry-after"]) >= 1
    assert body["error"]["code"] == ("rate_limited" if status == 429 else "unavailable")
    assert call(summarize, load_event("get_distributed.json"))[0] == 200  # the retry works


def test_payload_digests_never_change_for_the_same_body() -> None:
    """Stored events keep the digest they were written with: a retry after an upgrade must still be a
    duplicate, not a 422. These are the digests the first release computed."""
    from shared.ingest.bodies import validate_body
    from shared.ingest.parse import to_event

    body = {
        "step": 7,
        "world_size": 8,
        "rank": 3,
        "local_rank": 1,
        "weight": 1024,
        "time": 1764672000.125,
        "metrics": {"train/loss": 0.1, "b": "NaN", "é": -0.0, "n": 3},
    }
    plain = {"step": 0, "world_size": 1, "rank": 0, "metrics": {"a": 1.5}}
    digest = to_event("p", "r", validate_body(body), "e1", 0.0).payload_digest.hex()
    assert digest == "3283e5e7644a8b733a23cb25ef993184"
    assert to_event("p", "r", validate_body(plain), "e1", 0.0).payload_digest.hex() == (
        "d272eb8403e366e9f8e88ee83e50abe6"
    )
