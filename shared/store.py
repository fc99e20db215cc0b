"""The metrics table: one DynamoDB item per rank event, written with a conditional put.

Item layout (the key attribute names are the template's ``MetricsTable`` key schema; a test checks):

- ``pk`` = ``{project}#{run_id}#{shard:02x}`` with ``shard = rank % SHARDS`` (16). A run's writes
  spread over 16 partitions: 512 ranks x 2 events/s = 1,024 events/s is 64 write units/s per shard,
  far below the 1,000 write units/s of one partition, even though each shard's sort key grows with
  the step (which stops DynamoDB from splitting it further). A reader enumerates the 16 shards of a
  run without any index. 16 keeps the summary at 16 parallel queries; a run would need more than
  15,000 events/s before one shard saturates.
- ``sk`` = ``{step:016d}#{event_id}``: a step window is a key-range query (``BETWEEN``) on each shard,
  steps sort numerically, and late or out-of-order steps are just items with a smaller sort key.
- ``v`` (binary): little-endian float64 ``[weight, time, value_0, value_1, ...]``. Binary keeps NaN and
  Infinity (DynamoDB numbers cannot) and full float64 precision, and a run decodes with one
  ``numpy.frombuffer`` per item, no Python work per value.
- ``k``: the metric keys joined by newlines (keys cannot hold control characters).
- ``r``, ``ws``, ``lr``: rank, world size, local rank. ``h``: a 16-byte digest of the payload.

Idempotency without a second write: the put is conditional (``attribute_not_exists``) and asks for the
old item on failure (``ReturnValuesOnConditionCheckFailure=ALL_OLD``, no read to pay for). Equal
digests mean a replay (``duplicate``), different ones a reused id (``idempotency_key_reused``). A
typical event (2 keys: about 170 bytes; 20 keys of 20 characters: about 680 bytes) is one write unit
(``benchmarks/ingest.py`` prints these), and a replay costs one more (a failed conditional write is
billed like a write).

The trade-off of that choice: the id is unique per (run, shard, step), not per run. The same id sent
again with another step, or with a rank in another shard, is a different item and is stored as a
second event rather than refused with 422. Catching it would need an id item written next to every
event (2 write units per event, or 4 in a transaction: $0.625 or $1.875 more per million events on
top of the $0.64 per million this layout costs at 100 events per batch) only to catch a client bug:
the client draws
128-bit random ids per call and replays resend the same body, so a genuine retry always lands on the
same item. Such a stray event counts like any other event at its own (step, rank); where two events
share a (step, rank, key), the later ``time`` wins (contract 6).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from shared.models import EventIdReused, RankEvent, StoreThrottled, StoreUnavailable

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

SHARDS = 16
PARTITION_KEY = "pk"
SORT_KEY = "sk"
_STEP_DIGITS = 16  # 2**53 - 1 has 16 digits
#: Concurrent conditional puts of one batch: 1,000 events at ~5 ms a put take ~0.3 s, not 5 s.
PUT_CONCURRENCY = 16
#: A batch stops starting puts after this long and answers 503, well inside the 29 s function timeout.
BATCH_DEADLINE_S = 20.0
_THROTTLED = {"ProvisionedThroughputExceededException", "ThrottlingException", "RequestLimitExceeded"}
_UNAVAILABLE = {"InternalServerError", "ServiceUnavailable", "TransactionInProgressException"}

PutOutcome = Literal["stored", "duplicate"] | EventIdReused


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _put_pool() -> ThreadPoolExecutor:
    """One pool per process (a warm Lambda keeps it), created on the first batch."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=PUT_CONCURRENCY, thread_name_prefix="put")
        return _pool


@contextmanager
def store_errors(doing: str) -> Iterator[None]:
    """Calls that the table throttles, fails or does not answer become ``StoreThrottled`` (429) or
    ``StoreUnavailable`` (503): every write here is idempotent and every read repeatable, so the
    client's retry is always safe (for a put that timed out, whether or not it happened)."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _THROTTLED:
            raise StoreThrottled(f"the metrics table is throttling {doing} ({code}); retry shortly") from None
        if code in _UNAVAILABLE:
            raise StoreUnavailable(f"the metrics table is failing ({code}); retry shortly") from None
        raise
    except (BotoConnectionError, HTTPClientError) as exc:
        raise StoreUnavailable(
            f"the metrics table did not answer ({type(exc).__name__}); retry shortly"
        ) from None


def partition_key(project: str, run_id: str, shard: int) -> str:
    return f"{project}#{run_id}#{shard:02x}"


def sort_key(step: int, event_id: str) -> str:
    return f"{step:0{_STEP_DIGITS}d}#{event_id}"


def event_of_key(pk: str, sk: str) -> tuple[str, str, int] | None:
    """(project, run_id, step) of an event item's keys; None for any other item (``@`` partitions)."""
    parts = pk.split("#")
    if pk.startswith("@") or len(parts) != 3 or not sk[:_STEP_DIGITS].isdigit():
        return None
    return parts[0], parts[1], int(sk[:_STEP_DIGITS])


def item_of(event: RankEvent) -> dict[str, Any]:
    """The DynamoDB item of one event (the layout of this module's docstring)."""
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
    return item


def item_size(item: dict[str, Any]) -> int:
    """DynamoDB's size of an item in bytes: attribute names plus values (numbers approximated)."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        ((kind, data),) = value.items()
        if kind == "S":
            size += len(data.encode())
        elif kind == "B":
            size += len(data)
        else:  # N: about one byte per two significant digits, plus one
            size += 1 + (len(str(data).lstrip("-").replace(".", "")) + 1) // 2
    return size


def write_units(item: dict[str, Any]) -> int:
    """On-demand write units of one put of ``item``: one per started KB."""
    return max(1, -(-item_size(item) // 1024))


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
            from botocore.config import Config

            # Short timeouts and few attempts: a slow store becomes a 503 the client retries, never a
            # function timeout. One connection per concurrent put.
            config = Config(
                connect_timeout=2,
                read_timeout=5,
                retries={"mode": "standard", "max_attempts": 3},
                max_pool_connections=PUT_CONCURRENCY,
            )
            self._client = boto3.client("dynamodb", config=config)
        return self._client

    def put_event(self, event: RankEvent) -> Literal["stored", "duplicate"]:
        """Store ``event`` once. A retry with the same payload is a duplicate; another payload raises.

        Raises ``EventIdReused`` for another payload under a stored id, ``StoreThrottled`` (429) or
        ``StoreUnavailable`` (503) when the table throttles, fails or times out.
        """
        from botocore.exceptions import ClientError

        with store_errors("writes"):
            try:
                self.client.put_item(
                    TableName=self.table_name,
                    Item=item_of(event),
                    ConditionExpression="attribute_not_exists(#pk)",
                    ExpressionAttributeNames={"#pk": PARTITION_KEY},
                    ReturnValuesOnConditionCheckFailure="ALL_OLD",
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                    raise
                old: dict[str, Any] = exc.response.get("Item", {})  # type: ignore[assignment]
                if old.get("h", {}).get("B") == event.payload_digest:
                    return "duplicate"
                raise EventIdReused(
                    f"event {event.event_id!r} is already stored with a different payload"
                ) from None
        return "stored"

    def put_events(self, events: list[RankEvent]) -> list[PutOutcome]:
        """Store many events with concurrent conditional puts; one outcome per event, in order.

        A reused id is that event's outcome. If the table throttles or fails for any event, no
        further puts start and ``StoreThrottled``/``StoreUnavailable`` is raised for the whole batch:
        the events already stored are durable and a retry of the whole batch finds them as
        ``duplicate``, so the client never needs to know which ones made it.
        """
        if len(events) <= 1:
            return [self._outcome(e) for e in events]
        deadline = time.monotonic() + BATCH_DEADLINE_S
        failed: list[StoreUnavailable] = []

        def put(event: RankEvent) -> PutOutcome | None:
            if failed:
                return None  # the batch is already answered with a retryable error
            if time.monotonic() > deadline:
                failed.append(StoreUnavailable("the metrics table is slow; retry the batch shortly"))
                return None
            try:
                return self._outcome(event)
            except StoreUnavailable as exc:
                failed.append(exc)
                return None

        outcomes = list(_put_pool().map(put, events))
        if failed:
            # Throttling says "slow down" more precisely than a failure: prefer it.
            raise next((e for e in failed if isinstance(e, StoreThrottled)), failed[0])
        return [o for o in outcomes if o is not None]

    def _outcome(self, event: RankEvent) -> PutOutcome:
        try:
            return self.put_event(event)
        except EventIdReused as exc:
            return exc

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
        """One shard's events in the window; a throttling, failing or silent table raises 429/503."""
        with store_errors("reads"):
            yield from self._read_shard(pk, low, high)

    def _read_shard(self, pk: str, low: str, high: str) -> Iterator[StoredEvent]:
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
