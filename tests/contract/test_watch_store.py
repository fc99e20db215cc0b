"""What the watch (``shared.watch.rounds``) needs of the store (``WatchStore``, ``AlertStore``; contract 7):
the runs to watch by the server's clock across projects, the round's result kept on the run's record, and
a project's webhooks. Every test but the DynamoDB ones at the end runs once per adapter (SQLite, and
DynamoDB in moto with the template's runs table, its ``by_received`` index, the alerts table and the
alerts queue)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from shared.errors import StoreThrottled, StoreUnavailable
from shared.store.port import Delivery, LastDelivery, MetricsStore, RunActivity, Webhook

T0 = 1_700_000_000.25


class Clock:
    """The server's clock, set by the test."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _note(store: MetricsStore, project: str, run: str, time: float, step: int | None = 1) -> None:
    ranks = frozenset({0}) if step is not None else frozenset()
    store.note_activity(project, run, RunActivity(time, step, ranks, 1 if step is not None else None))


def _watched(store: MetricsStore, after: float, limit: int = 100) -> list[tuple[str, str, float | None]]:
    return [(p, r.run_id, r.received) for p, r in store.watched_runs(after, limit)]


def test_watched_runs_are_every_project_s_runs_by_the_server_s_clock_newest_first(
    store: MetricsStore,
) -> None:
    clock = Clock()
    store.clock = clock  # type: ignore[attr-defined]
    expected = []
    for i in range(12):  # enough runs to land in every watch shard
        clock.now = T0 + 10 * i
        project = f"proj-{i % 3}"
        # The events' own times are the clients' (here all older than the server's clock, in any
        # order): the list follows when the server received them.
        _note(store, project, f"run-{i:02d}", T0 - 1000 + (i * 7) % 12)
        expected.append((project, f"run-{i:02d}", T0 + 10 * i))
    expected.reverse()

    assert _watched(store, 0.0) == expected
    assert _watched(store, T0 + 75) == expected[:4]  # received at or after
    assert _watched(store, T0 + 70) == expected[:5]
    assert _watched(store, 0.0, limit=3) == expected[:3]
    assert _watched(store, T0 + 1000) == []
    assert store.watched_runs(0.0, 0) == []

    clock.now = T0 + 500  # new events of an old run put it first
    _note(store, "proj-1", "run-01", T0 - 900, step=2)
    assert _watched(store, 0.0, limit=2) == [("proj-1", "run-01", T0 + 500), expected[0]]
    clock.now = T0 + 600  # and so does an update (a config, the run finishing)
    store.update_run("proj-2", "run-02", T0 - 800, finished=True)
    top = store.watched_runs(0.0, 1)
    assert [(p, r.run_id, r.received, r.finished) for p, r in top] == [
        ("proj-2", "run-02", T0 + 600, T0 - 800)
    ]


def test_watched_runs_give_the_record_the_watch_reads(store: MetricsStore) -> None:
    store.clock = Clock(T0 + 5)  # type: ignore[attr-defined]
    store.note_activity("p", "r", RunActivity(T0, 7, frozenset({0, 1}), 4))
    store.update_run("p", "r", T0 - 1, config='{"lr": 0.1}')
    store.update_run("p", "r", T0 - 1, hosts={3: "node-b"})  # the watch names it in rank 3's findings

    ((project, record),) = store.watched_runs(T0, 10)
    assert record.hosts == {3: "node-b"}

    assert project == "p"
    assert (record.run_id, record.created, record.last_event, record.received) == ("r", T0, T0, T0 + 5)
    assert (record.last_step, record.world_size, record.ranks_reporting, record.finished) == (7, 4, 2, None)
    assert (record.watch, record.findings, record.headline) == (None, None, None)


def test_save_watch_keeps_state_counts_and_headline_on_the_record_without_moving_received(
    store: MetricsStore,
) -> None:
    store.clock = Clock(T0 + 5)  # type: ignore[attr-defined]
    _note(store, "p", "r", T0)
    state = json.dumps({"findings": [{"kind": "stopped_reporting", "rank": 5}], "watched_at": T0 + 60})
    counts = '{"critical": 1, "warning": 0, "info": 0}'

    store.save_watch("p", "r", state, counts, "rank 5 stopped", T0 + 60, [])

    record = store.get_run("p", "r")
    assert record is not None
    assert (record.watch, record.findings, record.findings_at, record.headline) == (
        state,
        counts,
        T0 + 60,
        "rank 5 stopped",
    )
    assert record.received == T0 + 5  # the watch's own write is not activity: no round sees it as new
    (listed,) = store.list_runs("p", 10)
    assert (listed.findings, listed.findings_at, listed.headline) == (counts, T0 + 60, "rank 5 stopped")
    ((_, watched),) = store.watched_runs(0.0, 10)
    assert (watched.watch, watched.findings, watched.headline) == (state, counts, "rank 5 stopped")

    store.save_watch("p", "r", "{}", '{"critical": 0, "warning": 0, "info": 0}', None, T0 + 120, [])
    record = store.get_run("p", "r")
    assert record is not None
    assert (record.watch, record.headline, record.findings_at) == ("{}", None, T0 + 120)
    assert store.list_runs("p", 10)[0].headline is None


def test_save_watch_of_a_run_without_a_record_makes_none(store: MetricsStore) -> None:
    store.save_watch("p", "gone", "{}", "{}", "rank 1 stopped", T0, [])
    assert store.get_run("p", "gone") is None
    assert store.watched_runs(0.0, 10) == []


def test_webhooks_round_trip_per_project_and_delete(store: MetricsStore) -> None:
    assert store.get_webhooks("p") == []
    hooks = [
        Webhook("https://hooks.example/services/T0/B0/x?y=1", "critical"),
        Webhook("http://127.0.0.1:8123/hook"),
    ]
    store.put_webhooks("p", hooks)
    store.put_webhooks("other", [Webhook("https://other.example/", "info")])

    assert store.get_webhooks("p") == hooks
    assert store.get_webhooks("other") == [Webhook("https://other.example/", "info")]

    store.put_webhooks("p", hooks[1:])  # replaces
    assert store.get_webhooks("p") == hooks[1:]
    assert store.delete_webhooks("p") is True
    assert store.get_webhooks("p") == []
    assert store.delete_webhooks("p") is False
    assert store.get_webhooks("other") == [Webhook("https://other.example/", "info")]


def test_a_webhooks_last_delivery_is_kept_overwritten_and_gone_with_its_project(store: MetricsStore) -> None:
    url, kept = "https://hooks.example/services/T0/B0/x", "http://127.0.0.1:8123/hook"
    store.note_delivery("p", url, LastDelivery("delivered", None, T0))  # no webhooks yet: nothing kept
    assert store.last_deliveries("p") == {}
    store.put_webhooks("p", [Webhook(url), Webhook(kept)])
    store.note_delivery("p", url, LastDelivery("failing", "the webhook answered HTTP 500", T0))
    refused = LastDelivery("refused", "the webhook's host resolves to 169.254.169.254", T0 + 1)
    store.note_delivery("p", url, refused)
    store.note_delivery("p", kept, LastDelivery("delivered", None, T0 + 2))
    assert store.last_deliveries("p") == {
        url: refused,
        kept: LastDelivery("delivered", None, T0 + 2),
    }
    assert store.last_deliveries("other") == {}
    store.put_webhooks("p", [Webhook(kept, "critical")])  # a PUT keeps what is known of a kept webhook
    assert store.last_deliveries("p") == {kept: LastDelivery("delivered", None, T0 + 2)}
    store.delete_webhooks("p")
    store.put_webhooks("p", [Webhook(kept)])
    assert store.last_deliveries("p") == {}


# DynamoDB: the deliveries go to the alerts queue (SQS), before the record is updated.


@pytest.fixture
def dynamo(store: Any) -> Any:
    from shared.store.dynamodb import DynamoStore

    if not isinstance(store, DynamoStore):
        pytest.skip("the alerts queue is DynamoDB's (SQLite keeps an outbox table)")
    return store


def _queued(dynamo: Any) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    while True:
        answer = dynamo.sqs.receive_message(
            QueueUrl=os.environ["ALERTS_QUEUE_URL"], MaxNumberOfMessages=10, WaitTimeSeconds=0
        )
        if not answer.get("Messages"):
            return bodies
        bodies += [json.loads(m["Body"]) for m in answer["Messages"]]


def _delivery(i: int) -> Delivery:
    payload = {"text": f"CRITICAL p/r: rank {i} stopped", "state": "opened", "finding": {"rank": i}}
    return Delivery(f"id-{i:02d}", "p", f"https://hooks.example/{i}", payload)


def test_watch_save_on_dynamodb_queues_each_delivery_as_the_deliver_function_reads_it(dynamo: Any) -> None:
    _note(dynamo, "p", "r", T0)
    sends = [_delivery(i) for i in range(23)]  # three SendMessageBatch calls

    dynamo.save_watch("p", "r", "{}", "{}", "rank 0 stopped", T0, sends)

    queued = sorted(_queued(dynamo), key=lambda body: body["delivery_id"])
    assert queued == [
        {"delivery_id": d.delivery_id, "project": d.project, "url": d.url, "payload": d.payload}
        for d in sends
    ]
    record = dynamo.get_run("p", "r")
    assert (record.watch, record.headline) == ("{}", "rank 0 stopped")


class FailingQueue:
    def __init__(self, code: str) -> None:
        self.code = code
        self.calls = 0

    def send_message_batch(self, **_: Any) -> Any:
        from botocore.exceptions import ClientError

        self.calls += 1
        raise ClientError({"Error": {"Code": self.code, "Message": "no"}}, "SendMessageBatch")


@pytest.mark.parametrize(
    ("code", "error"), [("RequestThrottled", StoreThrottled), ("InternalError", StoreUnavailable)]
)
def test_watch_save_on_dynamodb_keeps_no_state_when_the_queue_fails(
    dynamo: Any, code: str, error: type[Exception]
) -> None:
    _note(dynamo, "p", "r", T0)
    dynamo._sqs = FailingQueue(code)

    with pytest.raises(error):
        dynamo.save_watch("p", "r", '{"open": 1}', "{}", "rank 0 stopped", T0, [_delivery(0)])

    record = dynamo.get_run("p", "r")  # the next round decides again, with the same delivery ids
    assert (record.watch, record.headline) == (None, None)


def test_watch_save_on_dynamodb_with_nothing_to_send_calls_no_queue(dynamo: Any) -> None:
    _note(dynamo, "p", "r", T0)
    dynamo._sqs = FailingQueue("InternalError")
    dynamo.save_watch("p", "r", "{}", "{}", None, T0, [])
    assert dynamo._sqs.calls == 0
