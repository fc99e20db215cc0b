"""What invokes the functions besides HTTP: the SQLite change feed's rollup worker (the table's stream on
AWS), a DynamoDB stream poller (an event source mapping), the schedule (EventBridge) and the alerts'
delivery worker (the SQS queue's consumer)."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Any

from infra import wiring
from infra.local.events import lambda_records, scheduled_event
from infra.local.workers import FunctionWorkers, leave_signals_to_the_stack, settle_gc
from shared.store import ROLLUP_FEED
from shared.watch.nudges import nudge_event, nudged_runs

FEED_NAME = ROLLUP_FEED
#: How much lower the rollup worker's CPU priority is than ingest's and the summaries' (``os.nice``).
ROLLUP_NICE = 5
FEED_BATCH = 10_000


DELIVER_POLL_S = 0.5
DELIVER_THREADS = 4


def _matches(pattern: dict[str, Any], record: dict[str, Any]) -> bool:
    """An event filter pattern (the subset the template uses: exact values, nested fields)."""
    for name, allowed in pattern.items():
        value = record.get(name)
        if isinstance(allowed, dict):
            if not isinstance(value, dict) or not _matches(allowed, value):
                return False
        elif not isinstance(allowed, list) or any(isinstance(a, dict) for a in allowed):
            raise ValueError(f"the local stack cannot apply the filter {pattern!r}; extend _matches")
        elif value not in allowed:
            return False
    return True


class StreamPoller:
    """Reads a table's stream and invokes a function with its records, as an event source mapping.

    A batch whose function raises is retried (after a pause) until it succeeds or the stack stops.
    """

    def __init__(self, source: wiring.StreamSource, table_name: str, function: Any, endpoint: str) -> None:
        """``function`` runs the template's function (``FunctionWorkers``); ``endpoint``: DynamoDB's URL."""
        self.source = source
        self._function = function
        self._streams = streams_client(endpoint)
        self._arn = dynamodb_client(endpoint).describe_table(TableName=table_name)["Table"]["LatestStreamArn"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"stream-{source.function}")
        self.batches = 0  # batches handled

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a poller that dies would stop rollups silently
                if self._stop.is_set():
                    return  # the stack is stopping and its tables are going
                traceback.print_exc()
                self._stop.wait(1.0)

    def _poll(self) -> None:
        shard = self._streams.describe_stream(StreamArn=self._arn)["StreamDescription"]["Shards"][0]
        iterator = self._streams.get_shard_iterator(
            StreamArn=self._arn, ShardId=shard["ShardId"], ShardIteratorType=self.source.starting_position
        )["ShardIterator"]
        pending: list[dict[str, Any]] = []
        while not self._stop.is_set():
            while len(pending) < self.source.batch_size:
                page = self._streams.get_records(
                    ShardIterator=iterator, Limit=min(1000, self.source.batch_size - len(pending))
                )
                iterator = page["NextShardIterator"]
                pending += lambda_records(page["Records"], self._arn)
                if not page["Records"]:
                    break
            batch = [
                r
                for r in pending
                if not self.source.filters or any(_matches(f, r) for f in self.source.filters)
            ]
            if not batch:
                pending = []
                self._stop.wait(0.1)
                continue
            try:
                self._function.invoke({"Records": batch})
            except Exception:  # noqa: BLE001 - as Lambda does: report, then retry the batch
                traceback.print_exc()
                self._stop.wait(1.0)
                continue
            pending = []
            self.batches += 1


def streams_client(endpoint: str | None = None) -> Any:
    """A DynamoDB Streams client at the table's endpoint (DynamoDB Local and moto answer both APIs
    there), with no account-based endpoint, which botocore would otherwise build from a stream ARN's
    account."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "dynamodbstreams",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_DYNAMODB"),
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=Config(account_id_endpoint_mode="disabled"),
    )


def dynamodb_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "dynamodb", endpoint_url=endpoint, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    )


def roll_up_feed(database: str, environment: dict[str, str], stop: Any, parent: int) -> None:
    """The rollup worker of the SQLite stack: reads the database's change feed from where it left off
    and rolls the touched runs' blocks up with the rollup function's own logic (``shared.summary.rolling``).
    Its position is saved after each batch, so a restart resumes; a batch read twice after a crash is
    rolled up again, which changes nothing.

    It runs at a lower CPU priority (``ROLLUP_NICE``): when ingest takes both cores (a bulk sync, tens of
    thousands of events a second) the rollups fall behind and catch up after, as the stream's consumer
    does on AWS, rather than slow what clients wait for. Summaries stay exact meanwhile: what is not
    rolled up yet is read as events (``shared.summary.document``)."""
    leave_signals_to_the_stack()
    os.nice(ROLLUP_NICE)
    os.environ.update(environment)
    from shared.store.sqlite import SqliteStore
    from shared.summary.rolling import roll_up, touched_steps

    store = SqliteStore(database)
    settle_gc()
    position = store.feed_position(FEED_NAME)
    while not stop.is_set() and os.getppid() == parent:
        try:
            changes, after = store.read_changes(position, FEED_BATCH)
            if not changes:
                stop.wait(0.2)
                continue
            for (project, run_id), steps in sorted(touched_steps(changes).items()):
                roll_up(store, project, run_id, steps)
            store.save_feed_position(FEED_NAME, after)
            position = after
        except Exception:  # noqa: BLE001 - a feed that dies would stop rollups silently: report, retry
            traceback.print_exc()
            stop.wait(1.0)


#: How often the schedule looks at its nudge file (``shared.watch.nudges``).
NUDGE_POLL_S = 0.2


class Schedule:
    """Invokes a function every ``every_s`` seconds, as EventBridge does, one round at a time (a round
    that runs long delays the next instead of overlapping it). With ``nudges`` (a file that ingest
    appends a nudge event to, one per line: ``functions/ingest/nudge.py``), a nudge's round runs at once,
    as the rule of the watch's EventBridge bus does on AWS."""

    def __init__(
        self,
        source: wiring.ScheduleSource,
        workers: FunctionWorkers,
        every_s: float,
        nudges: str | None = None,
    ) -> None:
        self.source, self.workers, self.every_s, self.nudges = source, workers, every_s, nudges
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"schedule-{source.function}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        due = time.monotonic() + self.every_s
        poll = min(NUDGE_POLL_S, self.every_s) if self.nudges else self.every_s
        while not self._stop.wait(max(0.0, min(poll, due - time.monotonic()))):
            runs = self._take_nudges()
            if runs:
                self._invoke(nudge_event(sorted(runs)))
            if time.monotonic() >= due:
                self._invoke(scheduled_event(self.source, time.time()))
                due = time.monotonic() + self.every_s

    def _invoke(self, event: dict[str, Any]) -> None:
        try:
            self.workers.invoke(event)
        except Exception:  # noqa: BLE001 - a round that failed is reported; the next one runs
            if not self._stop.is_set():
                traceback.print_exc()

    def _take_nudges(self) -> set[tuple[str, str]]:
        """The runs nudged since the last look (the file is taken whole: a nudge written meanwhile starts
        a new one)."""
        if not self.nudges:
            return set()
        taken = self.nudges + ".taken"
        runs: set[tuple[str, str]] = set()
        try:
            os.replace(self.nudges, taken)
            with open(taken, "rb") as f:
                for line in f:
                    try:
                        runs |= nudged_runs(json.loads(line)) or set()
                    except ValueError:
                        continue  # a torn line: the next scheduled round judges its run
            os.unlink(taken)
        except FileNotFoundError:
            pass
        except OSError:  # a disk that refuses: the scheduled rounds go on
            traceback.print_exc()
        return runs


def deliver_alerts(database: str, allowed_networks: str, stop: Any, parent: int) -> None:
    """The local stack's delivery worker: sends the alerts the watch queued in the database (its
    outbox), retrying with backoff (``shared.watch.alerts``), through the outgoing-request policy
    (``allowed_networks``, as the deliver function's ``WEBHOOK_ALLOWED_NETWORKS``); what is queued
    survives a restart."""
    leave_signals_to_the_stack()
    from functools import partial

    from shared.store.sqlite import SqliteStore
    from shared.watch.alerts import deliver_due
    from shared.watch.egress import Policy
    from shared.watch.webhooks import send

    store = SqliteStore(database)
    post = partial(send, policy=Policy.parse(allowed_networks))
    while not stop.is_set() and os.getppid() == parent:
        try:
            if not deliver_due(store, time.time(), post, DELIVER_THREADS):
                stop.wait(DELIVER_POLL_S)
        except Exception:  # noqa: BLE001 - a worker that dies would stop alerts silently: report, retry
            traceback.print_exc()
            stop.wait(1.0)
