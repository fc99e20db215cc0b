"""The watch on AWS, with real parts: the scheduled function invoked with a real EventBridge scheduled
event (events/watch-schedule.json) over a run ingested through the real ingest function (real API
Gateway v2 events), in moto with the template's tables and queues; then the deliver function with the
SQS event the queue's messages make, posting to a real webhook receiver on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.conftest import Context, call, load_event, with_body

PROJECT, RUN = "distributed-job", "r1"  # the project the sample token grants, the events' run
BATCH = "post_rank_metrics_batch.json"
WORLD = 4
STOPPED = 3  # the rank that stops at step 9 while the others go on to step 59


class Receiver:
    """A webhook receiver on a free loopback port: answers ``status`` and keeps what it was sent."""

    def __init__(self) -> None:
        self.status = 200
        self.received: list[tuple[dict[str, str], Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    hook = Receiver()
    yield hook
    hook.close()


def api_event(method: str, path: str, route: str, body: Any = None) -> dict[str, Any]:
    """A real HTTP API (payload 2.0) event for another route, made from the sample batch event."""
    event = load_event(BATCH)
    event["routeKey"] = event["requestContext"]["routeKey"] = f"{method} {route}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    event["pathParameters"] = {"project": PROJECT}
    event["body"] = None if body is None else json.dumps(body)
    return event


def ingest_run(handlers: dict[str, Any], now: float) -> None:
    """Ranks 0-2 log steps 0..59, a step a second up to a second ago; rank 3 stops after step 9."""
    start = now - 60
    for rank in range(WORLD):
        last = 9 if rank == STOPPED else 59
        events = [
            {
                "step": step,
                "rank": rank,
                "world_size": WORLD,
                "local_rank": rank,
                "metrics": {"train/loss": 2.0 - step / 100 + rank / 1000},
                "time": start + step + rank / 100,
                "event_id": f"r{rank}-s{step}",
            }
            for step in range(last + 1)
        ]
        status, _, body = call(
            handlers["IngestFunction"],
            with_body(load_event(BATCH), {"events": events}, idempotency_key=f"b{rank}"),
        )
        assert status in (200, 201), body


def sqs_event(messages: Sequence[Mapping[str, Any]], queue_arn: str) -> dict[str, Any]:
    """The event Lambda's SQS event source mapping gives the deliver function for these messages."""
    return {
        "Records": [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m.get("Attributes", {}),
                "messageAttributes": {},
                "md5OfBody": m["MD5OfBody"],
                "eventSource": "aws:sqs",
                "eventSourceARN": queue_arn,
                "awsRegion": "us-east-1",
            }
            for m in messages
        ]
    }


@pytest.mark.slow
def test_a_scheduled_round_finds_the_stopped_rank_queues_one_alert_and_the_deliver_function_posts_it(
    handlers: dict[str, Any], receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from shared.store.dynamodb import DynamoStore

    # The receiver is on loopback, which a deployment allows only when its WebhookAllowedNetworks
    # parameter lists it (as it would an in-VPC chat server's CIDR).
    monkeypatch.setenv("WEBHOOK_ALLOWED_NETWORKS", "127.0.0.0/8")
    alerts = "/v1/projects/{project}/alerts"
    put = api_event("PUT", f"/v1/projects/{PROJECT}/alerts", alerts, {"webhooks": [{"url": receiver.url}]})
    status, _, body = call(handlers["AlertsFunction"], put)
    expected = {"url": receiver.url, "min_severity": "warning", "last_delivery": None}
    assert (status, body["webhooks"]) == (200, [expected])
    ingest_run(handlers, time.time())

    schedule = load_event("watch-schedule.json")
    figures = handlers["WatchFunction"](schedule, Context())

    assert (figures["runs"], figures["summarized"], figures["failed"]) == (1, 1, 0)
    assert figures["deliveries"] == figures["transitions"] >= 1
    store = DynamoStore("test-metrics", runs_table=os.environ["RUNS_TABLE"])
    record = store.get_run(PROJECT, RUN)
    assert record is not None
    assert record.watch is not None
    assert record.findings is not None
    assert json.loads(record.findings)["critical"] >= 1
    assert record.headline == f"rank {STOPPED} stopped"
    kept = json.loads(record.watch)["findings"]
    assert (kept[0]["kind"], kept[0]["rank"], kept[0]["severity"]) == (
        "stopped_reporting",
        STOPPED,
        "critical",
    )

    sqs = boto3.client("sqs")
    queue = os.environ["ALERTS_QUEUE_URL"]
    answer = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, AttributeNames=["All"])
    messages = answer["Messages"]
    bodies = [json.loads(m["Body"]) for m in messages]
    stopped = [b for b in bodies if b["payload"]["finding"]["kind"] == "stopped_reporting"]
    assert len(stopped) == 1
    assert len(bodies) == figures["deliveries"]
    (alert,) = stopped
    assert (alert["project"], alert["url"]) == (PROJECT, receiver.url)
    payload = alert["payload"]
    assert (payload["state"], payload["project"], payload["run_id"]) == ("opened", PROJECT, RUN)
    assert payload["finding"]["rank"] == STOPPED
    assert payload["finding"]["severity"] == "critical"
    assert payload["text"].startswith(f"CRITICAL {PROJECT}/{RUN}: rank {STOPPED}")
    assert payload["url"].endswith(f"/v1/projects/{PROJECT}/runs/{RUN}/distributed/view")

    # The next round: the same onset is not alerted twice.
    again = handlers["WatchFunction"](schedule, Context())
    assert (again["runs"], again["deliveries"], again["failed"]) == (1, 0, 0)

    # The deliver function, with the event the queue's messages make: one POST each.
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    answer = handlers["DeliverFunction"](sqs_event(messages, arn), Context())
    assert answer == {"batchItemFailures": []}
    assert len(receiver.received) == len(messages)
    posted = {headers["x-instantml-delivery"]: body for headers, body in receiver.received}
    assert posted[alert["delivery_id"]] == payload
    assert all(h["content-type"] == "application/json" for h, _ in receiver.received)
    get = api_event("GET", f"/v1/projects/{PROJECT}/alerts", alerts)
    last = call(handlers["AlertsFunction"], get)[2]["webhooks"][0]["last_delivery"]
    assert (last["state"], last["reason"]) == ("delivered", None)

    # A receiver that fails: the message is reported as failed, so SQS hands it back later.
    receiver.status = 500
    answer = handlers["DeliverFunction"](sqs_event(messages[:1], arn), Context())
    assert answer == {"batchItemFailures": [{"itemIdentifier": messages[0]["MessageId"]}]}
    assert len(receiver.received) == len(messages) + 1
    last = call(handlers["AlertsFunction"], get)[2]["webhooks"][0]["last_delivery"]
    assert (last["state"], last["reason"]) == ("failing", "the webhook answered HTTP 500")

    # The same deployment without loopback in its networks: refused at send time, said in GET, and
    # the message is done (a refusal is not retried), with nothing sent.
    monkeypatch.setenv("WEBHOOK_ALLOWED_NETWORKS", "")
    answer = handlers["DeliverFunction"](sqs_event(messages[:1], arn), Context())
    assert answer == {"batchItemFailures": []}
    assert len(receiver.received) == len(messages) + 1
    last = call(handlers["AlertsFunction"], get)[2]["webhooks"][0]["last_delivery"]
    assert last["state"] == "refused"
    assert "127.0.0.1 is loopback" in last["reason"]


@pytest.mark.slow
def test_the_deliver_function_refuses_every_forbidden_target_and_never_retries_it(
    handlers: dict[str, Any], receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued alerts whose URL (as stored before this policy, or by a name that resolves inward) points
    at metadata, link-local or loopback targets, through the deliver function on moto's queue: each is
    refused, none is sent or handed back to SQS, and the last delivery says why."""
    from shared.watch import egress
    from tests.unit.test_egress import FORBIDDEN_ON_AWS, INWARD, NEVER

    monkeypatch.setenv("WEBHOOK_ALLOWED_NETWORKS", "")
    alerts = "/v1/projects/{project}/alerts"
    name = "chat.example"  # what a hostile DNS answers for it: each forbidden address in turn
    put = api_event(
        "PUT", f"/v1/projects/{PROJECT}/alerts", alerts, {"webhooks": [{"url": f"http://{name}/"}]}
    )
    assert call(handlers["AlertsFunction"], put)[0] == 200
    queued = [*NEVER, *INWARD, *[f"http://{name}/"] * len(FORBIDDEN_ON_AWS), receiver.url]
    answers = iter(FORBIDDEN_ON_AWS)
    monkeypatch.setattr(egress, "_resolve", lambda host, port: [next(answers)])
    records = [
        {
            "messageId": f"m{n}",
            "body": json.dumps(
                {"delivery_id": f"d{n}", "project": PROJECT, "url": url, "payload": {"text": "x"}}
            ),
        }
        for n, url in enumerate(queued)
    ]
    answer = handlers["DeliverFunction"]({"Records": records}, Context())
    assert answer == {"batchItemFailures": []}  # refused: done, not retried
    assert receiver.received == []  # nothing got through, the loopback receiver included
    get = api_event("GET", f"/v1/projects/{PROJECT}/alerts", alerts)
    last = call(handlers["AlertsFunction"], get)[2]["webhooks"][0]["last_delivery"]
    assert last["state"] == "refused" and "resolves to" in last["reason"], last


@pytest.mark.slow
def test_a_failed_end_nudges_the_watch_which_judges_that_run_at_once(
    handlers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contract 8 on AWS: ingest's PATCH with a process's ``ended`` exception puts one event on the
    watch's bus (``WATCH_NUDGE``, the template's ``!Ref WatchNudgeBus``) however many ranks end; the
    event the bus's rule delivers is a round over that run alone, which names the rank."""
    import boto3
    from botocore.stub import Stubber

    from functions.ingest import nudge
    from shared.watch.nudges import Throttle

    ingest_run(handlers, time.time())
    other = load_event(BATCH)  # another live run, which the nudge's round must leave alone
    event = {"step": 0, "rank": 0, "world_size": 2, "metrics": {"x": 1.0}, "event_id": "o-0"}
    other["rawPath"] = other["requestContext"]["http"]["path"] = (
        f"/v1/projects/{PROJECT}/runs/other/rank-metrics/batch"
    )
    other["pathParameters"] = {"project": PROJECT, "run_id": "other"}
    assert call(handlers["IngestFunction"], with_body(other, {"events": [event]}))[0] in (200, 201)
    monkeypatch.setenv("WATCH_NUDGE", "instantml-watch-nudges")  # the bus: !Ref WatchNudgeBus
    client = boto3.client("events")
    stub = Stubber(client)
    # One event on the bus, naming this run (a second one would find no response: an error).
    entry = {
        "Source": "instantml.ingest",
        "DetailType": "process ended",
        "Detail": json.dumps({"nudge": [[PROJECT, RUN]]}, separators=(",", ":")),
        "EventBusName": "instantml-watch-nudges",
    }
    stub.add_response(
        "put_events", {"FailedEntryCount": 0, "Entries": [{"EventId": "1"}]}, {"Entries": [entry]}
    )
    invoked: list[Any] = []  # every put tried (a failed one is only logged by the nudge)
    client.meta.events.register(
        "provide-client-params.events.PutEvents", lambda params, **_: invoked.append(params)
    )
    monkeypatch.setattr(nudge, "_client", client)
    monkeypatch.setattr(nudge, "_throttle", Throttle())
    run_path, route = f"/v1/projects/{PROJECT}/runs/{RUN}", "/v1/projects/{project}/runs/{run_id}"
    now = time.time()

    def record(rank: int, state: str, **fields: Any) -> None:
        who = {"rank": rank, "world_size": WORLD, "pid": 100 + rank}
        patch = api_event(
            "PATCH", run_path, route, {"process": {**who, "state": state, **fields}, "time": now}
        )
        patch["pathParameters"] = {"project": PROJECT, "run_id": RUN}
        status, _, body = call(handlers["IngestFunction"], patch)
        assert status == 200, body

    with stub:
        for rank in range(WORLD):
            record(rank, "started", first_step=0)
        oom = {"type": "RuntimeError", "message": "CUDA out of memory", "where": "train.py:40 forward"}
        record(1, "ended", how="exception", exception=oom, step=59)
        for rank in (0, 2, 3):  # the launcher's SIGTERMs that follow: the same run, not nudged again
            record(rank, "ended", how="signal", signal="SIGTERM", step=59)
        stub.assert_no_pending_responses()
    assert len(invoked) == 1, invoked
    # The event the rule hands the watch, as EventBridge delivers it.
    delivered = {
        "version": "0",
        "id": "1",
        "source": entry["Source"],
        "detail-type": entry["DetailType"],
        "account": "000000000000",
        "time": "2026-12-07T00:00:00Z",
        "region": "us-east-1",
        "resources": [],
        "detail": json.loads(entry["Detail"]),
    }
    figures = handlers["WatchFunction"](delivered, Context())
    assert (figures["runs"], figures["failed"]) == (1, 0)  # that run alone, not "other"
    from shared.store.dynamodb import DynamoStore

    kept = DynamoStore("test-metrics", runs_table=os.environ["RUNS_TABLE"]).get_run(PROJECT, RUN)
    assert kept is not None and kept.watch is not None
    rows = [f for f in json.loads(kept.watch)["findings"] if f["severity"] != "info"]
    assert [(f["kind"], f["rank"]) for f in rows] == [("rank_exited", 1)], rows
