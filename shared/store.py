"""The metrics table: one DynamoDB item per rank event, written with a conditional put.

Item layout (the key attribute names are the template's ``MetricsTable`` key schema; a test checks):

- ``pk`` = ``{project}#{run_id}#{shard:02x}`` with ``shard = rank % SHARDS``. A run's writes spread
  over ``SHARDS`` partitions (512 ranks x 2 events/s is 64 writes/s per shard, far below the
  1,000 write units/s of one partition), and a reader enumerates the shards of a run.
- ``sk`` = ``{step:016d}#{event_id}``: a step window is a key-range query on every shard, and the key
  is unique per event id so that the conditional put itself is the idempotency record (no second
  write on the happy path).
- ``v`` (binary): little-endian float64 ``[weight, time, value_0, value_1, ...]``. Binary keeps NaN
  and Infinity (DynamoDB numbers cannot) and decodes with one ``numpy.frombuffer`` per item.
- ``k``: the metric keys joined by newlines (keys cannot hold control characters).
- ``r``, ``ws``, ``lr``: rank, world size, local rank. ``h``: the payload digest.

A typical event (a few keys) is well under 1 KB, so it costs one write unit.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from shared.models import EventIdReused, RankEvent, StoreUnavailable

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

SHARDS = 16
PARTITION_KEY = "pk"
SORT_KEY = "sk"
_STEP_DIGITS = 16  # 2**53 - 1 has 16 digits
_RETRYABLE = {
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
}


def partition_key(project: str, run_id: str, shard: int) -> str:
    return f"{project}#{run_id}#{shard:02x}"


def sort_key(step: int, event_id: str) -> str:
    return f"{step:0{_STEP_DIGITS}d}#{event_id}"


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One stored event as the summary reads it: the values still packed."""

    event_id: str
    step: int
    rank: int
    world_size: int
    keys: list[str]
    packed: bytes  # float64 [weight, time, *values]


class MetricsStore:
    """Writes and reads rank events. The boto3 client is created on first use (or injected)."""

    def __init__(self, table_name: str | None = None, client: DynamoDBClient | None = None) -> None:
        self.table_name = table_name or os.environ["METRICS_TABLE"]
        self._client = client

    @property
    def client(self) -> DynamoDBClient:
        if self._client is None:
            import boto3

            self._client = boto3.client("dynamodb")
        return self._client

    def put_event(self, event: RankEvent) -> Literal["stored", "duplicate"]:
        """Store ``event`` once. A retry with the same payload is a duplicate; another payload raises."""
        from botocore.exceptions import ClientError

        packed = struct.pack(f"<{2 + len(event.values)}d", event.weight, event.time, *event.values)
        item: dict[str, Any] = {
            PARTITION_KEY: {"S": partition_key(event.project, event.run_id, event.rank % SHARDS)},
            SORT_KEY: {"S": sort_key(event.step, event.event_id)},
            "r": {"N": str(event.rank)},
            "ws": {"N": str(event.world_size)},
            "k": {"S": "\n".join(event.keys)},
            "v": {"B": packed},
            "h": {"B": event.payload_digest},
        }
        if event.local_rank is not None:
            item["lr"] = {"N": str(event.local_rank)}
        try:
            self.client.put_item(
                TableName=self.table_name,
                Item=item,
                ConditionExpression="attribute_not_exists(#pk)",
                ExpressionAttributeNames={"#pk": PARTITION_KEY},
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "ConditionalCheckFailedException":
                old: dict[str, Any] = exc.response.get("Item", {})  # type: ignore[assignment]
                if old.get("h", {}).get("B") == event.payload_digest:
                    return "duplicate"
                raise EventIdReused(
                    f"event {event.event_id!r} is already stored with a different payload"
                ) from None
            if code in _RETRYABLE:
                raise StoreUnavailable(f"the metrics table is busy ({code}); retry shortly") from None
            raise
        return "stored"

    def query_run(
        self, project: str, run_id: str, step_min: int = 0, step_max: int | None = None
    ) -> list[StoredEvent]:
        """Every stored event of a run with ``step_min <= step <= step_max``, from all shards."""
        low = f"{step_min:0{_STEP_DIGITS}d}#"
        high = f"{(10**_STEP_DIGITS - 1) if step_max is None else step_max:0{_STEP_DIGITS}d}#\U0010ffff"
        shards = range(SHARDS)
        with ThreadPoolExecutor(max_workers=8) as pool:
            parts = pool.map(
                lambda s: list(self._query_shard(partition_key(project, run_id, s), low, high)), shards
            )
            return [event for part in parts for event in part]

    def query_run_bounded(
        self, project: str, run_id: str, step_min: int, step_max: int | None, max_items: int
    ) -> tuple[list[StoredEvent], int | None]:
        """Like :meth:`query_run`, but reads about ``max_items`` items at most (spread over the shards).

        Returns the events and, when a shard had more, the last step through which the result is
        complete (every shard read past it; later events are dropped), else None.
        """
        low = f"{step_min:0{_STEP_DIGITS}d}#"
        high = f"{(10**_STEP_DIGITS - 1) if step_max is None else step_max:0{_STEP_DIGITS}d}#\U0010ffff"
        per_shard = max(1, max_items // SHARDS)

        def read(shard: int) -> tuple[list[StoredEvent], bool]:
            events: list[StoredEvent] = []
            for event in self._query_shard(partition_key(project, run_id, shard), low, high):
                events.append(event)
                if len(events) > per_shard:
                    return events, True
            return events, False

        with ThreadPoolExecutor(max_workers=8) as pool:
            parts = list(pool.map(read, range(SHARDS)))
        truncated = [events[-1].step for events, cut in parts if cut]
        if not truncated:
            return [event for events, _ in parts for event in events], None
        through = min(truncated) - 1  # a cut shard may hold only part of its last step
        return [event for events, _ in parts for event in events if event.step <= through], through

    def _query_shard(self, pk: str, low: str, high: str) -> Iterator[StoredEvent]:
        paginator = self.client.get_paginator("query")
        pages = paginator.paginate(
            TableName=self.table_name,
            KeyConditionExpression="#pk = :pk AND #sk BETWEEN :low AND :high",
            ExpressionAttributeNames={"#pk": PARTITION_KEY, "#sk": SORT_KEY},
            ExpressionAttributeValues={":pk": {"S": pk}, ":low": {"S": low}, ":high": {"S": high}},
            ProjectionExpression="#sk, r, ws, k, v",
        )
        for page in pages:
            for item in page.get("Items", []):
                sk = item[SORT_KEY]["S"]
                yield StoredEvent(
                    event_id=sk[_STEP_DIGITS + 1 :],
                    step=int(sk[:_STEP_DIGITS]),
                    rank=int(item["r"]["N"]),
                    world_size=int(item["ws"]["N"]),
                    keys=item["k"]["S"].split("\n"),
                    packed=item["v"]["B"],
                )
