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
top of the $0.625 a write unit per event costs, about $0.8 to $1.0 per million events all-in at 512 ranks:
``benchmarks/aws_model.py``) only to catch a client bug:
the client draws
128-bit random ids per call and replays resend the same body, so a genuine retry always lands on the
same item. Such a stray event counts like any other event at its own (step, rank); where two events
share a (step, rank, key), the later ``time`` wins (contract 6).

Rollups (``shared.rollups``) live in the same table as the events (its ``pk``/``sk`` schema), under
partition keys that start with ``@`` (no project name can, so they never meet an event's partition):

- block item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``{block:016d}``; ``h`` =
  ``BlockHeader.packed()`` (first and last step, distinct steps, world size, events read, and per rank
  steps reported, first and last step when some rank missed a step), ``k`` = the block's keys joined
  by newlines, ``n`` = events read.
- key item: ``pk`` = ``@rollup#{project}#{run_id}#{key}``, ``sk`` = ``{block:016d}``; ``vz`` = that key's
  sums over the block per rank (``rollups.pack_key_units``: 24 bytes a rank, 12 KB at 512 ranks),
  zlib-compressed (about 4 KB at 512 ranks: a third of the write and read units; items written before
  hold them plain in ``v``), ``n``. A store keeps the sums it read (``SumsCache``) and reads again only
  the blocks whose header says they were rolled up from more events since.
- progress item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``~progress``: ``f`` = every block up
  to this one has been rolled up (or had no events when it was looked at).

Every put is conditional on ``n`` (or ``f``) growing: events are only ever added, so a rollup
that read more events is the newer one, and two rollers racing on one block leave the newer result.

Only the rollup function writes here: its policy allows ``dynamodb:PutItem`` on the table with the
condition ``dynamodb:LeadingKeys`` like ``@rollup#*`` (template.yaml), so it can never change an event.

Scalars (``run.log``, ``ScalarStore``) are items of the same table in one partition per run,
``pk`` = ``@scalars#{project}#{run_id}``, with the events' sort key and attributes and the same
conditional put. A run logs about one scalar event per step, far below a partition's limit; the ``@``
keeps them out of the rollup stream (``event_of_key``), and the runs function may query only these
partitions (``dynamodb:LeadingKeys`` like ``@scalars#*``).

The runs table (``RunStore``), keys ``project`` and ``run_id``. A run has three kinds of item:

- its own item (``run_id``): ``created``, ``last_event``, ``finished``, ``findings``, ``findings_at``
  (and the watch's attributes below). An item exists only once ``last_event`` is set (every update that
  makes one sets it). Both indexes hold it, so it must stay small and rarely written: a note writes it
  only for a newer time, and the ingest holds a note's time back up to ``run_time_resolution_s`` (1 s)
  when its step part is new (``shared.runs.ActivityNotes``): about one write a second per ingest
  instance, however many ranks report. The index ``by_activity`` (``project``, ``last_event``) lists a
  project's runs newest first.
- its config (``{run_id}#config``, ``config``: JSON text up to 64 KiB), written by run updates only:
  DynamoDB bills a write by the whole item, and a config on the run's item was paid on every note (a
  64 KiB config: 64 write units per note).
- its rank groups (``{run_id}#s00`` .. ``#s15``: ranks 0-31, 32-63, ...; ``#s-`` for a step noted
  without ranks): for each rank, ``s{rank}`` (its last step) and ``w{rank}`` (its world size there).
  A rank's note only grows its own two attributes, so the ranks of a group never contend (one
  conditional update applies, whatever the others did). The record's last step is the largest rank
  step, its ranks those whose last step it is: the same record one item would hold, while 512 ranks'
  notes spread over 16 items of at most a few hundred bytes that no index holds (a 512-rank number set
  on the run's item was 1.4 KB, paid on every write of it and again in both indexes).

No run id holds ``#``, which sorts before every character one may hold, so a run's items are one key
range (``[run_id, run_id#\U0010ffff]``): ``get_run`` is one query, ``list_runs`` and ``watched_runs``
one index query and one small query per run listed. Each field that "only grows" is a conditional
``UpdateItem`` (an update expression cannot take a maximum), so updates are idempotent and commute; a
failed condition returns the item as it was, and the store remembers what it saw, so a note usually
sends only the write that applies, and none for what is recorded already.

The watch (contract 7) adds to a run's own item ``received`` (the server's clock when an update of its
time last applied) and ``watch_shard`` (``w0``..``w3``, a hash of its keys), both set inside the
activity updates, so the index ``by_received`` (``watch_shard``, ``received``) lists every project's
recent runs in ``WATCH_SHARDS`` queries; and ``watch`` (the watch's state: zlib-compressed JSON,
binary) and ``headline``, written by the watch alone. A project's webhooks are one item of the alerts
table (``project``, ``webhooks``: JSON text); the alerts a round decides go to the alerts queue (SQS).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import re
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from shared.errors import EventIdReused, StoreThrottled, StoreUnavailable
from shared.rollups import BlockHeader, RolledBlock, unpack_header
from shared.store.port import (
    Delivery,
    EventPage,
    PutOutcome,
    RollupProgress,
    RunActivity,
    RunRecord,
    RunStatus,
    StoredEvent,
    Webhook,
)
from shared.tokens import HASH_KEY, TokenRecord, new_token, token_hash

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import SendMessageBatchRequestEntryTypeDef

    from shared.events import Event, RankEvent, ScalarEvent

SHARDS = 16
PARTITION_KEY = "pk"
SORT_KEY = "sk"
_STEP_DIGITS = 16  # 2**53 - 1 has 16 digits
#: Concurrent conditional puts of one batch: 1,000 events at ~5 ms a put take ~0.3 s, not 5 s.
PUT_CONCURRENCY = 16
#: A batch stops starting puts after this long and answers 503, well inside the 29 s function timeout.
BATCH_DEADLINE_S = 20.0
_THROTTLED = {
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestThrottled",  # SQS
    "AWS.SimpleQueueService.RequestThrottled",
}
_UNAVAILABLE = {"InternalServerError", "ServiceUnavailable", "TransactionInProgressException"}

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


#: The tables' TTL attribute (template.yaml: TimeToLiveSpecification): epoch seconds after which DynamoDB
#: deletes the item (within a few days). Written only when the deployment sets a retention.
EXPIRES = "expires"
#: Days what the ingest writes is kept (template.yaml: RetentionDays); 0 or unset keeps it.
RETENTION_ENV = "RETENTION_DAYS"

ROLLUP_PREFIX = "@rollup#"
SCALARS_PREFIX = "@scalars#"
PROGRESS_SK = "~rolled"  # sorts after every block's key ("~progress", the single level's, is left alone)


#: zlib's level for a key's sums (``vz``): 24 bytes a rank become about 8 (a rank's total stays about
#: 8 bytes, its weight sum and counts repeat across ranks), a third of the write and read units.
SUMS_COMPRESSION = 6
#: Bytes of decoded sums a store keeps between calls (``SumsCache``): a warm summarize function reads
#: only the blocks that changed. A 512-rank run's 1,000 level-100 blocks of 4 keys are about 49 MB.
SUMS_CACHE_BYTES = 160_000_000


def _block_sums(item: dict[str, Any]) -> bytes:
    """A key item's packed sums: ``vz`` (zlib) as written now, ``v`` (plain) as written before."""
    if "vz" in item:
        return zlib.decompress(item["vz"]["B"])
    return item["v"]["B"]  # type: ignore[no-any-return]


class SumsCache:
    """Rolled sums read before, kept with the events they were rolled from (``n``) and served only
    while the block's header, as last read, says the same ``n``: stored events are only ever added, so
    a block's sums for a given ``n`` never change. Least recently used go first past ``max_bytes``."""

    def __init__(self, max_bytes: int = SUMS_CACHE_BYTES, max_levels: int = 256) -> None:
        from collections import OrderedDict

        self.max_bytes, self.max_levels, self.bytes = max_bytes, max_levels, 0
        self._seen: OrderedDict[tuple[str, str, int], dict[int, int]] = OrderedDict()
        self._sums: OrderedDict[tuple[str, str, int, str, int], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def saw(self, project: str, run_id: str, size: int, n_events: dict[int, int]) -> None:
        """Blocks' events read as their headers were just read."""
        with self._lock:
            seen = self._seen.setdefault((project, run_id, size), {})
            seen.update(n_events)
            self._seen.move_to_end((project, run_id, size))
            while len(self._seen) > self.max_levels:
                self._seen.popitem(last=False)

    def lookup(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> tuple[dict[str, dict[int, bytes]], dict[str, list[tuple[int, int]]]]:
        """Per key, the cached sums of blocks ``first..last`` that match their headers, and the block
        ranges still to read: the blocks whose headers were read (a caller uses the sums of those
        only), or the whole window when no header of this level in it was read."""
        cached: dict[str, dict[int, bytes]] = {key: {} for key in keys}
        ranges: dict[str, list[tuple[int, int]]] = {key: [] for key in keys}
        with self._lock:
            seen = self._seen.get((project, run_id, size), {})
            blocks = sorted(b for b in seen if first <= b <= last)
            if not blocks:
                return cached, {key: [(first, last)] for key in keys}
            for key in keys:
                gap = True  # a cached block since the last range: the next missing block opens one
                for block in blocks:
                    entry = self._sums.get((project, run_id, size, key, block))
                    if entry is not None and entry[0] == seen[block]:
                        self._sums.move_to_end((project, run_id, size, key, block))
                        cached[key][block] = entry[1]
                        gap = True
                    elif gap:
                        ranges[key].append((block, block))
                        gap = False
                    else:
                        ranges[key][-1] = (ranges[key][-1][0], block)
        return cached, ranges

    def keep(self, project: str, run_id: str, size: int, key: str, block: int, n: int, sums: bytes) -> None:
        with self._lock:
            old = self._sums.pop((project, run_id, size, key, block), None)
            if old is not None:
                self.bytes -= len(old[1])
            if len(sums) > self.max_bytes:
                return
            self._sums[(project, run_id, size, key, block)] = (n, sums)
            self.bytes += len(sums)
            while self.bytes > self.max_bytes:
                self.bytes -= len(self._sums.popitem(last=False)[1][1])


def block_sort_key(size: int, block: int) -> str:
    """A rolled block's sort key: its level, then its number, so that one level's blocks are a range."""
    return f"{size:05d}:{block:0{_STEP_DIGITS}d}"


def block_of_sort_key(key: str) -> int:
    return int(key.partition(":")[2])


def block_partition(project: str, run_id: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}"


def key_partition(project: str, run_id: str, key: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}#{key}"


def scalar_partition(project: str, run_id: str) -> str:
    return f"{SCALARS_PREFIX}{project}#{run_id}"


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


def item_of(event: Event, pk: str | None = None, expires: int | None = None) -> dict[str, Any]:
    """The DynamoDB item of one event (the layout of this module's docstring), in its shard's
    partition unless ``pk`` names another (a scalar's); with ``expires`` (epoch seconds) the table's
    TTL deletes it after that time."""
    packed = struct.pack(f"<{2 + len(event.values)}d", event.weight, event.time, *event.values)
    if pk is None:
        pk = partition_key(event.project, event.run_id, event.rank % SHARDS)
    item: dict[str, Any] = {
        PARTITION_KEY: {"S": pk},
        SORT_KEY: {"S": sort_key(event.step, event.event_id)},
        "r": {"N": str(event.rank)},
        "ws": {"N": str(event.world_size)},
        "k": {"S": "\n".join(event.keys)},
        "v": {"B": packed},
        "h": {"B": event.payload_digest},
    }
    if event.local_rank is not None:
        item["lr"] = {"N": str(event.local_rank)}
    if expires is not None:
        item[EXPIRES] = {"N": str(expires)}
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


class DynamoStore:
    """The store port on DynamoDB (events, scalars and rollups in the metrics table, run records in the
    runs table). The boto3 client is created on first use (or injected)."""

    #: A note whose step part is new may leave the run's time as recorded for up to this long
    #: (``RunStore``): the run's own item, which both indexes hold, is then written about once a second.
    run_time_resolution_s = 1.0
    #: The most events a summary reads one by one (``shared.summary``): botocore parses an item in
    #: tens of microseconds, so a summary stays within a few seconds of CPU at the function's memory.
    raw_read_budget = 25_000

    def __init__(
        self,
        table_name: str | None = None,
        client: DynamoDBClient | None = None,
        runs_table: str | None = None,
        alerts_table: str | None = None,
        alerts_queue: str | None = None,
        clock: Callable[[], float] = time.time,
        sqs: SQSClient | None = None,
        retention_days: float | None = None,
    ) -> None:
        """``clock`` is the server's: when a run's events are received (tests set it). ``retention_days``
        (default: ``RETENTION_DAYS``, else 0): events, scalars and run records written carry ``expires``,
        that long after they were written; 0 keeps them."""
        self.table_name = table_name or os.environ["METRICS_TABLE"]
        if retention_days is None:
            retention_days = float(os.environ.get(RETENTION_ENV) or 0)
        self.retention_s = max(0.0, retention_days) * 86400
        self._alerts_table, self._alerts_queue = alerts_table, alerts_queue
        self.clock = clock
        self._client = client
        self._sqs = sqs
        # Read when first used: a function that keeps no run records (the rollup) has no RUNS_TABLE.
        self._runs_table = runs_table
        #: Each run's ``last_event`` as this store last saw it recorded: it only grows, so this spares
        #: writes that cannot apply, never needed ones.
        self._recorded_times: dict[tuple[str, str], float] = {}
        self._sums = SumsCache()

    @property
    def runs_table(self) -> str:
        name = self._runs_table or os.environ.get("RUNS_TABLE")
        if not name:
            raise RuntimeError("no runs table: pass runs_table or set RUNS_TABLE")
        return name

    @property
    def alerts_table(self) -> str:
        if not self._alerts_table:  # the store URL's ``alerts`` (only the functions that use it name it)
            raise RuntimeError("no alerts table: the store URL names none (dynamodb://T?alerts=...)")
        return self._alerts_table

    @property
    def alerts_queue(self) -> str:
        if not self._alerts_queue:
            raise RuntimeError("no alerts queue: the store URL names none (dynamodb://T?queue=...)")
        return self._alerts_queue

    @property
    def sqs(self) -> SQSClient:
        if self._sqs is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=2, read_timeout=5, retries={"mode": "standard", "max_attempts": 3}
            )
            self._sqs = boto3.client("sqs", config=config)
        return self._sqs

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
        return self._put_once(item_of(event), event)

    def _put_once(self, item: dict[str, Any], event: Event) -> Literal["stored", "duplicate"]:
        """The conditional put of one event's (or scalar's) item, told apart as ``put_event`` says."""
        from botocore.exceptions import ClientError

        with store_errors("writes"):
            try:
                self.client.put_item(
                    TableName=self.table_name,
                    Item=item,
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
        expires = self._expires()
        return self._put_many(events, lambda e: item_of(e, expires=expires))

    def put_scalars(self, events: list[ScalarEvent]) -> list[PutOutcome]:
        """As ``put_events``, each scalar event in its run's ``@scalars#`` partition."""
        expires = self._expires()
        return self._put_many(events, lambda e: item_of(e, scalar_partition(e.project, e.run_id), expires))

    def _expires(self) -> int | None:
        """``expires`` of what is written now (None: kept)."""
        return int(self.clock() + self.retention_s) if self.retention_s else None

    def _expiring(self, update: str, values: dict[str, Any]) -> str:
        """``update`` with ``expires`` set too when the deployment keeps a retention (its value added)."""
        expires = self._expires()
        if expires is None:
            return update
        values[":exp"] = {"N": str(expires)}
        if "SET " in update:
            return update.replace("SET ", "SET #exp = :exp, ", 1)
        return f"{update} SET #exp = :exp"

    def _put_many(self, events: Sequence[Event], item: Callable[[Event], dict[str, Any]]) -> list[PutOutcome]:
        def outcome(event: Event) -> PutOutcome:
            try:
                return self._put_once(item(event), event)
            except EventIdReused as exc:
                return exc

        if len(events) <= 1:
            return [outcome(e) for e in events]
        deadline = time.monotonic() + BATCH_DEADLINE_S
        failed: list[StoreUnavailable] = []

        def put(event: RankEvent) -> PutOutcome | None:
            if failed:
                return None  # the batch is already answered with a retryable error
            if time.monotonic() > deadline:
                failed.append(StoreUnavailable("the metrics table is slow; retry the batch shortly"))
                return None
            try:
                return outcome(event)
            except StoreUnavailable as exc:
                failed.append(exc)
                return None

        outcomes = list(_put_pool().map(put, events))
        if failed:
            # Throttling says "slow down" more precisely than a failure: prefer it.
            raise next((e for e in failed if isinstance(e, StoreThrottled)), failed[0])
        return [o for o in outcomes if o is not None]

    def read_events(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """The run's events in the window from all 16 shards, read in parallel.

        With ``max_items``, each shard reads about ``max_items / 16`` items at most; when a shard had
        more, the result is cut after the last step every shard read past (``complete_through``).
        """
        low, high = _window(step_min, step_max)
        per_shard = None if max_items is None else max(1, max_items // SHARDS)

        def read(shard: int) -> tuple[list[StoredEvent], bool]:
            events: list[StoredEvent] = []
            for event in self._query_shard(partition_key(project, run_id, shard), low, high):
                events.append(event)
                if per_shard is not None and len(events) > per_shard:
                    return events, True
            return events, False

        with ThreadPoolExecutor(max_workers=8) as pool:
            parts = list(pool.map(read, range(SHARDS)))
        truncated = [events[-1].step for events, cut in parts if cut]
        if not truncated:
            return EventPage([event for events, _ in parts for event in events])
        through = min(truncated) - 1  # a cut shard may hold only part of its last step
        return EventPage([e for events, _ in parts for e in events if e.step <= through], through)

    def next_step(self, project: str, run_id: str, step_min: int, step_max: int | None = None) -> int | None:
        """One item per shard (16 queries of ``Limit=1``): work follows the items, not the step range."""
        low, high = _window(step_min, step_max)

        def first(shard: int) -> int | None:
            with store_errors("reads"):
                items = self.client.query(
                    TableName=self.table_name,
                    KeyConditionExpression="#pk = :pk AND #sk BETWEEN :low AND :high",
                    ExpressionAttributeNames={"#pk": PARTITION_KEY, "#sk": SORT_KEY},
                    ExpressionAttributeValues={
                        ":pk": {"S": partition_key(project, run_id, shard)},
                        ":low": {"S": low},
                        ":high": {"S": high},
                    },
                    ProjectionExpression="#sk",
                    Limit=1,
                ).get("Items", [])
            return int(items[0][SORT_KEY]["S"][:_STEP_DIGITS]) if items else None

        with ThreadPoolExecutor(max_workers=8) as pool:
            found = [s for s in pool.map(first, range(SHARDS)) if s is not None]
        return min(found) if found else None

    def read_scalars(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """The run's scalar events in the window: one partition in step order, so a read capped by
        ``max_items`` stops after ``max_items + 1`` items and keeps the steps before the last one."""
        low, high = _window(step_min, step_max)
        events: list[StoredEvent] = []
        for event in self._query_shard(scalar_partition(project, run_id), low, high):
            events.append(event)
            if max_items is not None and len(events) > max_items:
                through = events[max_items].step - 1  # the last step may be cut: keep the steps before
                return EventPage([e for e in events if e.step <= through], through)
        return EventPage(events)

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
            ProjectionExpression="#sk, r, ws, lr, k, v",
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
                    local_rank=int(item["lr"]["N"]) if "lr" in item else None,
                )

    # Run records (the runs table)

    def _received(self, project: str, run_id: str) -> dict[str, Any]:
        """The values of ``RECEIVED_SET``: the server's clock now and the run's watch shard."""
        return {":now": _number(self.clock()), ":wsh": {"S": watch_shard(project, run_id)}}

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        """The time part on the run's item when it is newer than what this store knows is recorded there
        (one conditional update: ``created`` with the first, ``received`` and ``watch_shard`` with each,
        ``RECEIVED_SET``); then the step part on the rank groups the activity touches (``_note_group``).

        The run's item is the one the indexes hold, and the only item every note would otherwise write:
        ``shared.runs.ActivityNotes`` holds a note's time back for up to ``run_time_resolution_s`` when
        only its step part is new, so that item is written at most about once a second per process
        however many ranks report, while the step part goes to 16 small items that no index holds."""
        key = (project, run_id)
        if activity.time > self._recorded_times.get(key, -math.inf):
            applied, old = self._update_run_item(
                project,
                run_id,
                f"SET #c = if_not_exists(#c, :t), #le = :t, {RECEIVED_SET}",
                {":t": _number(activity.time), **self._received(project, run_id)},
                condition="attribute_not_exists(#le) OR #le < :t",
                expiring=True,
            )
            _remember(self._recorded_times, key, activity.time if applied else float(old["last_event"]["N"]))
        if activity.step is not None:
            for group, ranks in _rank_groups(activity.ranks):
                self._note_group(project, run_id, group, activity.step, ranks, activity.world_size)

    def _note_group(
        self,
        project: str,
        run_id: str,
        group: str,
        step: int,
        ranks: frozenset[int],
        world_size: int | None,
    ) -> None:
        """Each rank's last step and its world size there, as attributes of the rank's own
        (``s{rank}``, ``w{rank}``; ``sn``, ``wn`` for a step noted without ranks) on its group's item.

        A rank's note only ever grows its own attributes, so the ranks of a group never contend: one
        conditional update (the rank's step grows) applies in the usual case, whatever the other ranks
        did. A newer step replaces the rank's world size; the same step keeps the larger one; an older
        one changes nothing. A failed condition (a late or replayed batch) returns the item as it was,
        which says, rank by rank, what is left to write."""
        members: list[int | None] = [*sorted(ranks)] if ranks else [None]
        item_id = group_item(run_id, group)
        update, values, condition = self._rank_steps_update(members, step, world_size)
        applied, old = self._update_run_item(project, item_id, update, values, condition, expiring=True)
        if applied:
            return
        for member in members:  # rank by rank: newer, the same step with a larger world size, or older
            s_name, w_name = _rank_attributes(member)
            recorded = old.get(s_name)
            recorded_step = int(float(recorded["N"])) if recorded else None
            if recorded_step is not None and recorded_step > step:
                continue
            if recorded_step is None or recorded_step < step:
                update, values, condition = self._rank_steps_update([member], step, world_size)
            else:
                recorded_ws = int(float(old[w_name]["N"])) if w_name in old else None
                if world_size is None or (recorded_ws is not None and recorded_ws >= world_size):
                    continue
                update = f"SET #{w_name} = :ws"
                values = {":s": _number(step), ":ws": _number(world_size)}
                condition = f"#{s_name} = :s AND (attribute_not_exists(#{w_name}) OR #{w_name} < :ws)"
            # (another note of the same rank may have raced it: its condition then fails, which is right)
            self._update_run_item(project, item_id, update, values, condition, expiring=True)

    @staticmethod
    def _rank_steps_update(
        members: list[int | None], step: int, world_size: int | None
    ) -> tuple[str, dict[str, Any], str]:
        """Set each member's step (and world size, or remove it), if each one's step grows."""
        sets, removes, conditions = [], [], []
        values: dict[str, Any] = {":s": _number(step)}
        if world_size is not None:
            values[":ws"] = _number(world_size)
        for member in members:
            s_name, w_name = _rank_attributes(member)
            sets.append(f"#{s_name} = :s")
            if world_size is None:
                removes.append(f"#{w_name}")
            else:
                sets.append(f"#{w_name} = :ws")
            conditions.append(f"(attribute_not_exists(#{s_name}) OR #{s_name} < :s)")
        update = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
        return update, values, " AND ".join(conditions)

    def update_run(
        self,
        project: str,
        run_id: str,
        time: float,
        config: str | None = None,
        finished: bool = False,
        hosts: dict[int, str] | None = None,
    ) -> RunRecord:
        """The config on its own item (``{run_id}#config``: never rewritten with the activity), each
        rank's host as its own attribute ``h{rank}`` of its rank group's item (as its step: ranks never
        contend), then one update of the run's item when ``time`` is the latest activity (the usual case),
        else a second one without the activity part; the record is then read back (one query). An update
        that applies sets ``received`` and ``watch_shard`` too (see ``note_activity``)."""
        if config is not None:
            self._update_run_item(
                project, config_item(run_id), "SET #cfg = :cfg", {":cfg": {"S": config}}, expiring=True
            )
        said = hosts or {}
        for group, ranks in _rank_groups(frozenset(said)) if said else []:
            sets = ", ".join(f"#h{rank} = :h{rank}" for rank in sorted(ranks))
            values = {f":h{rank}": {"S": said[rank]} for rank in ranks}
            self._update_run_item(project, group_item(run_id, group), "SET " + sets, values, expiring=True)
        rest = ["#fin = if_not_exists(#fin, :t)"] if finished else []
        applied, _ = self._update_run_item(
            project,
            run_id,
            "SET " + ", ".join(["#c = if_not_exists(#c, :t)", "#le = :t", *rest, RECEIVED_SET]),
            {":t": _number(time), **self._received(project, run_id)},
            condition="attribute_not_exists(#le) OR #le < :t",
            expiring=True,
        )
        if applied:
            _remember(self._recorded_times, (project, run_id), time)
        elif rest or config is not None:  # a later activity is recorded: the item exists, with ``created``
            self._update_run_item(
                project,
                run_id,
                "SET " + ", ".join([*rest, RECEIVED_SET]),
                {**({":t": _number(time)} if finished else {}), **self._received(project, run_id)},
                expiring=True,
            )
        record = self.get_run(project, run_id)
        assert record is not None  # the item has ``last_event`` now
        return record

    def note_findings(self, project: str, run_id: str, findings: str, at: float) -> None:
        """Names only ``run_id``, ``findings`` and ``findings_at`` (the summarize role may touch no
        other attribute): an item exists only with ``last_event``, so ``attribute_exists(run_id)`` is
        the port's "a run that has a record"."""
        self._update_run_item(
            project,
            run_id,
            "SET #f = :f, #fat = :at",
            {":f": {"S": findings}, ":at": _number(at)},
            condition="attribute_exists(#r) AND (attribute_not_exists(#fat) OR #fat <= :at)",
        )

    def get_run(self, project: str, run_id: str) -> RunRecord | None:
        """One query of the run's items: its own, its config's and its rank groups'."""
        items = self._run_items(project, run_id, run_id, consistent=True)
        main = next((item for item in items if item["run_id"]["S"] == run_id), None)
        if main is None or "last_event" not in main:
            return None
        return _run_record(main, items)

    def _run_items(
        self, project: str, run_id: str, low: str, consistent: bool = False
    ) -> list[dict[str, Any]]:
        """The run's items from ``low`` on (the run's own id: all of them; ``{run_id}#``: its config and
        rank groups; ``{run_id}#s``: its rank groups): the run ids of other runs never fall in the range,
        since ``#`` sorts before every character a run id may hold."""
        key = "#p = :p AND #r BETWEEN :low AND :high"
        query: dict[str, Any] = {
            "TableName": self.runs_table,
            "KeyConditionExpression": key,
            "ExpressionAttributeNames": _names(key),
            "ExpressionAttributeValues": {
                ":p": {"S": project},
                ":low": {"S": low},
                ":high": {"S": f"{run_id}#\U0010ffff"},
            },
            "ConsistentRead": consistent,
        }
        items: list[dict[str, Any]] = []
        with store_errors("reads"):
            while True:
                page = self.client.query(**query)
                items += page.get("Items", [])
                if "LastEvaluatedKey" not in page:
                    return items
                query["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def _merged(self, runs: list[tuple[str, dict[str, Any]]], side: str) -> list[tuple[str, RunRecord]]:
        """Index entries (project, item) made whole with their runs' own items after ``{run_id}{side}``
        (``#``: config and rank groups; ``#s``: rank groups only), queried in parallel."""

        def one(run: tuple[str, dict[str, Any]]) -> tuple[str, RunRecord]:
            project, item = run
            run_id = item["run_id"]["S"]
            return project, _run_record(item, self._run_items(project, run_id, run_id + side))

        if len(runs) <= 1:
            return [one(run) for run in runs]
        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(one, runs))

    def list_runs(
        self,
        project: str,
        limit: int,
        after: tuple[float, str] | None = None,
        statuses: frozenset[RunStatus] | None = None,
        idle_before: float = 0.0,
    ) -> list[RunRecord]:
        """Queries of the ``by_activity`` index, newest first, then one query per listed run for its
        config and rank groups (the index holds neither: both change or weigh too much to be copied
        into it on every write).

        The index orders by ``last_event`` only; among equal times its order is not defined. So the
        cursor is not an ``ExclusiveStartKey`` but a key condition ``last_event <= cursor`` (the runs
        of the cursor's time are read again and those not after it dropped), and pages are read until
        every run of the last kept time is in hand, then sorted by (``last_event``, ``run_id``)
        descending. Equal float times are rare, so the extra reads are too. A status filter becomes a
        key condition on ``idle_before`` and a filter on ``finished`` where it can, and is checked on
        each record in any case."""
        if limit < 1 or (statuses is not None and not statuses):
            return []
        wanted: frozenset[str] = frozenset(("live", "idle", "finished")) if statuses is None else statuses
        unfinished = wanted - {"finished"}
        only = "finished" not in wanted and len(unfinished) == 1
        high = None if after is None else after[0]  # last_event <= high (the cursor's time)
        low = idle_before if only and unfinished == {"live"} else None  # last_event >= low
        below = idle_before if only and unfinished == {"idle"} else None  # last_event < below
        if high is not None and below is not None:  # keep the stricter upper bound
            high, below = (high, None) if high < below else (None, below)
        values: dict[str, Any] = {":p": {"S": project}}
        if low is not None and high is not None:
            if high < low:
                return []
            key = "#p = :p AND #le BETWEEN :low AND :high"
        elif low is not None:
            key = "#p = :p AND #le >= :low"
        elif high is not None:
            key = "#p = :p AND #le <= :high"
        elif below is not None:
            key = "#p = :p AND #le < :below"
        else:
            key = "#p = :p"
        for name, bound in ((":low", low), (":high", high), (":below", below)):
            if bound is not None:
                values[name] = _number(bound)
        query: dict[str, Any] = {
            "TableName": self.runs_table,
            "IndexName": RUNS_INDEX,
            "KeyConditionExpression": key,
            "ScanIndexForward": False,
            "Limit": max(limit + 1, 100),
        }
        if "finished" not in wanted:
            query["FilterExpression"] = "attribute_not_exists(#fin)"
        elif not unfinished:
            query["FilterExpression"] = "attribute_exists(#fin)"
        expressions = [key, query.get("FilterExpression", "")]
        query["ExpressionAttributeNames"] = _names(*expressions)
        query["ExpressionAttributeValues"] = values

        def keep(record: RunRecord) -> bool:
            if after is not None and (record.last_event, record.run_id) >= after:
                return False
            if record.finished is not None:
                return "finished" in wanted
            return ("idle" if record.last_event < idle_before else "live") in wanted

        def order(entry: tuple[RunRecord, dict[str, Any]]) -> tuple[float, str]:
            return entry[0].last_event, entry[0].run_id

        entries: list[tuple[RunRecord, dict[str, Any]]] = []
        with store_errors("reads"):
            while True:
                page = self.client.query(**query)
                for item in page.get("Items", []):
                    record = _run_record(item)
                    if keep(record):
                        entries.append((record, item))
                last = page.get("LastEvaluatedKey")
                if last is None:
                    break
                if len(entries) >= limit:
                    entries.sort(key=order, reverse=True)
                    if float(last["last_event"]["N"]) < entries[limit - 1][0].last_event:
                        break  # every run of the last kept time is read
                query["ExclusiveStartKey"] = last
        entries.sort(key=order, reverse=True)
        return [record for _, record in self._merged([(project, item) for _, item in entries[:limit]], "#")]

    def _update_run_item(
        self,
        project: str,
        run_id: str,
        update: str,
        values: dict[str, Any],
        condition: str | None = None,
        return_new: bool = False,
        expiring: bool = False,
    ) -> tuple[bool, dict[str, Any]]:
        """One ``UpdateItem`` of an item of the runs table (a run's, or its config's or rank group's):
        (True, the new item when ``return_new``) when applied, (False, the item as it was) when
        ``condition`` failed. ``expiring``: it sets ``expires`` too, when the deployment keeps a
        retention (never in the updates of roles that may not name it: findings, the watch's)."""
        from botocore.exceptions import ClientError

        if expiring:
            values = dict(values)
            update = self._expiring(update, values)

        request: dict[str, Any] = {
            "TableName": self.runs_table,
            "Key": _run_key(project, run_id),
            "UpdateExpression": update,
            "ExpressionAttributeNames": _names(update, condition or ""),
            "ExpressionAttributeValues": values,
        }
        if condition is not None:
            request["ConditionExpression"] = condition
            request["ReturnValuesOnConditionCheckFailure"] = "ALL_OLD"
        if return_new:
            request["ReturnValues"] = "ALL_NEW"
        with store_errors("writes"):
            try:
                answer = self.client.update_item(**request)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                    raise
                return False, exc.response.get("Item", {})  # type: ignore[return-value]
        return True, answer.get("Attributes", {})

    # Rollups (the second half of the port), beside the events in the same table.

    # The watch and its alerts (contract 7): the runs table's ``by_received`` index, the alerts table,
    # and the alerts queue.

    def watched_runs(self, received_after: float, limit: int) -> list[tuple[str, RunRecord]]:
        """One query of ``WATCH_INDEX`` per watch shard (``WATCH_SHARDS``, in parallel), newest
        ``received`` first, each stopped once it has ``limit`` runs; merged, the newest ``limit``.

        The index holds the watch's state and the run's times; the step part (the last step, its ranks
        and world size) is then read from each listed run's rank groups, one small query a run (about
        0.5 read units): the groups change with every rank's batch, so no index copies them."""
        if limit < 1:
            return []
        key = "#wsh = :wsh AND #rcv >= :after"

        def shard(value: str) -> list[tuple[str, dict[str, Any]]]:
            query: dict[str, Any] = {
                "TableName": self.runs_table,
                "IndexName": WATCH_INDEX,
                "KeyConditionExpression": key,
                "ExpressionAttributeNames": _names(key),
                "ExpressionAttributeValues": {":wsh": {"S": value}, ":after": _number(received_after)},
                "ScanIndexForward": False,
                "Limit": min(limit, 1000),
            }
            found: list[tuple[str, dict[str, Any]]] = []
            with store_errors("reads"):
                while len(found) < limit:
                    page = self.client.query(**query)
                    found += [
                        (item["project"]["S"], item) for item in page.get("Items", []) if "last_event" in item
                    ]
                    if "LastEvaluatedKey" not in page:
                        break
                    query["ExclusiveStartKey"] = page["LastEvaluatedKey"]
            return found[:limit]

        with ThreadPoolExecutor(max_workers=WATCH_SHARDS) as pool:
            entries = [entry for part in pool.map(shard, watch_shards()) for entry in part]

        def order(entry: tuple[str, dict[str, Any]]) -> tuple[float, str, str]:
            project, item = entry
            received = float(item["received"]["N"]) if "received" in item else 0.0
            return received, project, item["run_id"]["S"]

        entries.sort(key=order, reverse=True)
        return self._merged(entries[:limit], "#s")

    def save_watch(
        self,
        project: str,
        run_id: str,
        state: str,
        counts: str,
        headline: str | None,
        at: float,
        deliveries: list[Delivery],
    ) -> None:
        """The round's deliveries onto the alerts queue first, then its result on the run's item.

        DynamoDB and SQS share no transaction, so the order makes "neither kept without the other" hold
        one way: a crash after the messages and before the update leaves the run's state as it was,
        and the next round takes the same decision again, with the same delivery ids (``shared.watch``
        names a delivery by its run, finding, onset, state and webhook). The queue may then hold that
        alert twice; it is never lost. Duplicates are bounded: one extra copy per crash (or failed
        update) between the two calls, each carrying the same ``X-InstantML-Delivery`` id, so a receiver
        that keeps recent ids drops it. (SQS's own deduplication works only on a FIFO queue, whose
        5-minute window would not cover a round repeated later either, and whose ordering would let one
        dead webhook hold back every alert behind it in its group: the queue stays standard, whose
        at-least-once delivery already means a receiver may see a repeat.) The other order would lose
        an alert whenever the send failed after the update.

        One ``UpdateItem`` names only the attributes the watch role may write (template.yaml:
        ``watch``, ``findings``, ``findings_at``, ``headline`` and the keys). The state is stored
        compressed (``_pack_watch``). ``shared.watch`` caps the findings it keeps (``KEPT_FINDINGS``) but not
        its open alerts: with 511 of 512 ranks stopped while one goes on, the state is 242 KB of JSON
        (575 open alerts), 10 KB compressed, and the run item 10.5 KB, against DynamoDB's 400 KB item
        (``benchmarks/watch_dynamodb.py`` prints it)."""
        self._send(deliveries)
        update = "SET #w = :w, #f = :f, #fat = :at" + (", #hl = :hl" if headline else " REMOVE #hl")
        values: dict[str, Any] = {":w": {"B": _pack_watch(state)}, ":f": {"S": counts}, ":at": _number(at)}
        if headline:
            values[":hl"] = {"S": headline}
        self._update_run_item(project, run_id, update, values, condition="attribute_exists(#r)")

    def _send(self, deliveries: list[Delivery]) -> None:
        """``SendMessageBatch`` 10 messages a call (SQS's most), each body what ``functions.deliver``
        reads. A message that SQS did not take fails the round for this run (it is retried whole)."""
        bodies = [
            json.dumps(
                {"delivery_id": d.delivery_id, "project": d.project, "url": d.url, "payload": d.payload},
                separators=(",", ":"),
                allow_nan=False,
            )
            for d in deliveries
        ]
        for i in range(0, len(bodies), SQS_BATCH):
            entries: list[SendMessageBatchRequestEntryTypeDef] = [
                {"Id": str(n), "MessageBody": body} for n, body in enumerate(bodies[i : i + SQS_BATCH])
            ]
            with queue_errors():
                answer = self.sqs.send_message_batch(QueueUrl=self.alerts_queue, Entries=entries)
            failed = answer.get("Failed") or []
            if failed:
                codes = sorted({f.get("Code", "?") for f in failed})
                if any(code in _THROTTLED for code in codes):
                    raise StoreThrottled(
                        f"the alerts queue is throttling ({', '.join(codes)}); retry shortly"
                    )
                raise StoreUnavailable(f"the alerts queue refused {len(failed)} alerts ({', '.join(codes)})")

    def get_webhooks(self, project: str) -> list[Webhook]:
        with store_errors("reads"):
            item = self.client.get_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ConsistentRead=True
            ).get("Item")
        if item is None:
            return []
        return [Webhook(**hook) for hook in json.loads(item["webhooks"]["S"])]

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        text = json.dumps([asdict(hook) for hook in webhooks], separators=(",", ":"))
        with store_errors("writes"):
            self.client.put_item(
                TableName=self.alerts_table, Item={"project": {"S": project}, "webhooks": {"S": text}}
            )

    def delete_webhooks(self, project: str) -> bool:
        with store_errors("writes"):
            answer = self.client.delete_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ReturnValues="ALL_OLD"
            )
        return "Attributes" in answer

    def read_blocks(self, project: str, run_id: str, size: int, first: int, last: int) -> list[BlockHeader]:
        """The rolled blocks of one level, ``first <= block <= last``, in block order. Each block's
        events read (``n``) is remembered: ``read_block_sums`` takes unchanged blocks' sums from its
        cache."""
        items = self._query_rollups(block_partition(project, run_id), size, first, last, "#sk, h, k")
        headers = [
            unpack_header(
                size, block_of_sort_key(item[SORT_KEY]["S"]), item["h"]["B"], item["k"]["S"].split("\n")
            )
            for item in items
        ]
        self._sums.saw(project, run_id, size, {h.block: h.n_events for h in headers})
        return headers

    def read_block_sums(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        """For each key, block -> packed sums, the keys queried in parallel: only the blocks whose sums
        this store has not cached for the events read its last ``read_blocks`` saw (``SumsCache``),
        one query per run of consecutive such blocks."""
        cached, ranges = self._sums.lookup(project, run_id, size, keys, first, last)

        def one(key: str) -> list[dict[str, Any]]:
            pk = key_partition(project, run_id, key)
            return [
                item
                for low, high in ranges[key]
                for item in self._query_rollups(pk, size, low, high, "#sk, v, vz, n")
            ]

        with ThreadPoolExecutor(max_workers=8) as pool:
            read = dict(zip(keys, pool.map(one, keys), strict=True))
        for key, items in read.items():
            for item in items:
                block = block_of_sort_key(item[SORT_KEY]["S"])
                sums = _block_sums(item)
                cached[key][block] = sums
                self._sums.keep(project, run_id, size, key, block, int(item["n"]["N"]), sums)
        return {key: dict(sorted(blocks.items())) for key, blocks in cached.items()}

    def write_blocks(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        """Write rolled blocks: each key's sums first, the block item last (it makes the block used)."""

        def put_block(rolled: RolledBlock) -> None:
            block = rolled.header
            sk = {"S": block_sort_key(block.size, block.block)}
            n = {"N": str(block.n_events)}
            for key, packed in rolled.sums.items():  # kept: the blocks above are combined from these
                self._sums.keep(project, run_id, block.size, key, block.block, block.n_events, packed)
                self._put_if_newer(
                    {
                        PARTITION_KEY: {"S": key_partition(project, run_id, key)},
                        SORT_KEY: sk,
                        "vz": {"B": zlib.compress(packed, SUMS_COMPRESSION)},
                        "n": n,
                    }
                )
            self._put_if_newer(
                {
                    PARTITION_KEY: {"S": block_partition(project, run_id)},
                    SORT_KEY: sk,
                    "h": {"B": block.packed()},
                    "k": {"S": "\n".join(block.keys)},
                    "n": n,
                }
            )

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(put_block, rolled))

    def rollup_progress(self, project: str, run_id: str) -> RollupProgress:
        with store_errors("reads"):
            item = self.client.get_item(
                TableName=self.table_name,
                Key={PARTITION_KEY: {"S": block_partition(project, run_id)}, SORT_KEY: {"S": PROGRESS_SK}},
                ConsistentRead=True,
            ).get("Item")
        return RollupProgress() if item is None else RollupProgress(int(item["f"]["N"]), item["nodes"]["B"])

    def late_steps(self, project: str, run_id: str, step_min: int, step_max: int, limit: int) -> list[int]:
        """None known: the stream's backlog is not readable here, and marking late steps at ingest would
        cost write units on every event. A late rank's events are in the summary once the rollup function
        has read them from the stream (its batching window, about a second)."""
        return []

    def advance_rollups(self, project: str, run_id: str, step: int, nodes: bytes) -> None:
        """Record progress unless another roller already recorded more."""
        self._put_if_newer(
            {
                PARTITION_KEY: {"S": block_partition(project, run_id)},
                SORT_KEY: {"S": PROGRESS_SK},
                "f": {"N": str(step)},
                "nodes": {"B": nodes},
            },
            "attribute_not_exists(#pk) OR f <= :f",
            {":f": {"N": str(step)}},
        )

    def _put_if_newer(
        self,
        item: dict[str, Any],
        condition: str = "attribute_not_exists(#pk) OR n <= :n",
        values: dict[str, Any] | None = None,
    ) -> None:
        from botocore.exceptions import ClientError

        try:
            with store_errors("writes"):
                self.client.put_item(
                    TableName=self.table_name,
                    Item=item,
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#pk": PARTITION_KEY},
                    ExpressionAttributeValues=values or {":n": item["n"]},
                )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            # another roller wrote a rollup that read more events (or recorded more progress)

    def _query_rollups(
        self, pk: str, size: int, first: int, last: int, projection: str
    ) -> Iterator[dict[str, Any]]:
        with store_errors("reads"):
            yield from self._read_rollups(pk, size, first, last, projection)

    def _read_rollups(
        self, pk: str, size: int, first: int, last: int, projection: str
    ) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("query")
        pages = paginator.paginate(
            TableName=self.table_name,
            KeyConditionExpression="#pk = :pk AND #sk BETWEEN :low AND :high",
            ExpressionAttributeNames={"#pk": PARTITION_KEY, "#sk": SORT_KEY},
            ExpressionAttributeValues={
                ":pk": {"S": pk},
                ":low": {"S": block_sort_key(size, first)},
                ":high": {"S": block_sort_key(size, min(last, 10**_STEP_DIGITS - 1))},
            },
            ProjectionExpression=projection,
        )
        for page in pages:
            yield from page.get("Items", [])


#: The runs table's index of a project's runs by ``last_event`` (template.yaml).
RUNS_INDEX = "by_activity"
#: The runs table's index of every project's runs by ``received`` (template.yaml): the watch's list.
WATCH_INDEX = "by_received"
#: Values of ``watch_shard`` (``w0``..): the index's partitions. A live run's own item changes about
#: once a second per ingest instance, and ``received`` (the index's sort key) with it, so one partition
#: would take every run's index writes; 4 spread them (a partition takes 1,000 writes/s) and a round
#: still costs only 4 queries.
WATCH_SHARDS = 4
#: Set in every update of a run's activity (``note_activity``, ``update_run``): the server's clock and the
#: run's watch shard, which together put the run in ``WATCH_INDEX``.
RECEIVED_SET = "#rcv = :now, #wsh = :wsh"
#: Messages per ``SendMessageBatch`` (SQS's most).
SQS_BATCH = 10
_BATCH_GET_ATTEMPTS = 6
#: Every attribute of a run's item, by the alias the expressions use (aliases avoid DynamoDB's reserved
#: words; a request names exactly the attributes its expressions use, which is what IAM checks).
_RUN_ATTRIBUTES = {
    "#p": "project",
    "#r": "run_id",
    "#c": "created",
    "#le": "last_event",
    "#ls": "last_step",
    "#ws": "world_size",
    "#rk": "ranks",
    "#fin": "finished",
    "#cfg": "config",
    "#f": "findings",
    "#fat": "findings_at",
    "#rcv": "received",
    "#wsh": "watch_shard",
    "#w": "watch",
    "#hl": "headline",
    "#exp": EXPIRES,
}
_ALIAS = re.compile(r"#\w+")


def _names(*expressions: str) -> dict[str, str]:
    """The ``ExpressionAttributeNames`` of exactly the aliases used (DynamoDB refuses unused ones): a run
    item's attributes, and a rank group's ``#s{rank}``/``#w{rank}`` (``#sn``/``#wn``) and ``#h{rank}``
    for themselves."""
    return {
        alias: _RUN_ATTRIBUTES.get(alias) or _rank_attribute(alias)
        for e in expressions
        for alias in _ALIAS.findall(e)
    }


_RANK_ALIAS = re.compile(r"#([sw](?:\d+|n)|h\d+)")


def _rank_attribute(alias: str) -> str:
    found = _RANK_ALIAS.fullmatch(alias)
    if found is None:
        raise KeyError(alias)
    return found.group(1)


def _rank_attributes(rank: int | None) -> tuple[str, str]:
    """A rank's attributes on its group's item: its last step and its world size there (``n``: a step
    noted without ranks)."""
    suffix = "n" if rank is None else str(rank)
    return f"s{suffix}", f"w{suffix}"


def watch_shards() -> list[str]:
    return [f"w{n}" for n in range(WATCH_SHARDS)]


def watch_shard(project: str, run_id: str) -> str:
    """A run's shard of ``WATCH_INDEX``: a stable hash of its keys (never Python's ``hash``, which
    changes from one process to the next)."""
    digest = zlib.crc32(f"{project}#{run_id}".encode("utf-8", "surrogatepass"))
    return f"w{digest % WATCH_SHARDS}"


def _pack_watch(state: str) -> bytes:
    """The watch's state as stored: zlib-compressed JSON. The run's own item is rewritten about once a
    second while the run is live and DynamoDB bills a write by the whole item's size, so the state's
    size is paid on each of those writes (and each index write); JSON findings compress about tenfold."""
    return zlib.compress(state.encode("utf-8", "surrogatepass"), 6)


def _unpack_watch(value: dict[str, Any]) -> str:
    if "S" in value:
        return str(value["S"])
    return zlib.decompress(value["B"]).decode("utf-8", "surrogatepass")


@contextmanager
def queue_errors() -> Iterator[None]:
    """The alerts queue's failures as the store's: throttling ``StoreThrottled``, anything else
    (an error answer, no answer) ``StoreUnavailable``. The watch retries the run next round."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _THROTTLED:
            raise StoreThrottled(f"the alerts queue is throttling ({code}); retry shortly") from None
        raise StoreUnavailable(f"the alerts queue failed ({code}); retry shortly") from None
    except BotoCoreError as exc:
        raise StoreUnavailable(f"the alerts queue did not answer ({type(exc).__name__})") from None


def _run_key(project: str, run_id: str) -> dict[str, Any]:
    return {"project": {"S": project}, "run_id": {"S": run_id}}


def _number(value: float) -> dict[str, str]:
    return {"N": repr(value)}  # repr: the shortest text that reads back as the same float


def _ranks(ranks: frozenset[int]) -> dict[str, list[str]]:
    return {"NS": [str(rank) for rank in sorted(ranks)]}


#: Ranks per rank group: a run's step part is kept on its rank groups' items (``{run_id}#s00`` ..
#: ``#s15`` at 512 ranks, ``#s-`` for a step noted without ranks), each written only by its own ranks'
#: notes, so that 512 ranks' batches spread over 16 items of under 1 KB that no index holds.
RANKS_PER_GROUP = 32
#: What follows a run id in the ids of its other items: no run id holds ``#``, and ``#`` sorts before
#: every character one may hold, so a run's items are the range ``[run_id, run_id#\U0010ffff]``.
CONFIG_ITEM, GROUP_ITEM = "#config", "#s"
#: Entries a store remembers of what the runs table holds (recorded times, rank groups seen).
REMEMBERED = 10_000


def config_item(run_id: str) -> str:
    return run_id + CONFIG_ITEM


def group_item(run_id: str, group: str) -> str:
    return run_id + GROUP_ITEM + group


def _rank_groups(ranks: frozenset[int]) -> list[tuple[str, frozenset[int]]]:
    """The activity's ranks by rank group; a step noted without ranks goes to the group ``-``."""
    if not ranks:
        return [("-", frozenset())]
    groups: dict[str, set[int]] = {}
    for rank in ranks:
        groups.setdefault(f"{rank // RANKS_PER_GROUP:02d}", set()).add(rank)
    return [(group, frozenset(members)) for group, members in sorted(groups.items())]


class _RankStep(NamedTuple):
    """One rank's last step and its world size there (``rank`` None: a step noted without ranks)."""

    step: int
    rank: int | None
    world_size: int | None


def _rank_steps(item: dict[str, Any]) -> list[_RankStep]:
    """The rank steps a rank group's item records, or those of a run's item written before the groups
    (``last_step``, ``ranks`` and ``world_size`` of its own)."""
    if "last_step" in item:
        step = int(float(item["last_step"]["N"]))
        size = int(float(item["world_size"]["N"])) if "world_size" in item else None
        ranks = [int(rank) for rank in item.get("ranks", {}).get("NS", [])]
        return [_RankStep(step, None, size)] + [_RankStep(step, rank, size) for rank in ranks]
    out = []
    for name, value in item.items():
        if name[:1] == "s" and (name[1:].isdigit() or name == "sn"):
            rank = None if name == "sn" else int(name[1:])
            size = item.get("w" + name[1:])
            out.append(_RankStep(int(float(value["N"])), rank, int(float(size["N"])) if size else None))
    return out


def _remember(memory: dict[Any, Any], key: Any, value: Any) -> None:
    """Remember ``value`` as the newest entry, forgetting the oldest beyond ``REMEMBERED``."""
    memory.pop(key, None)
    memory[key] = value
    if len(memory) > REMEMBERED:
        del memory[next(iter(memory))]


def _run_record(item: dict[str, Any], others: list[dict[str, Any]] | None = None) -> RunRecord:
    """A run's item (or its index entry) as a ``RunRecord``, with the step part merged from its rank
    groups among ``others`` (its items in the runs table) and its config from its config item.

    The last step is the largest of the ranks' (and of steps noted without ranks); the ranks reporting
    are those whose last step it is, their world size the largest there: the same record one item would
    hold, since a rank appears at the run's last step exactly when its own last step is that one. An item
    written before the groups (with ``last_step``, ``ranks`` and ``config`` of its own) counts too."""

    def number(name: str) -> float | None:
        return float(item[name]["N"]) if name in item else None

    def text(name: str) -> str | None:
        return item[name]["S"] if name in item else None

    run_id = item["run_id"]["S"]
    config = text("config")
    steps = _rank_steps(item)
    hosts: dict[int, str] = {}
    for other in others or []:
        other_id = other["run_id"]["S"]
        if other_id == config_item(run_id) and "config" in other:
            config = other["config"]["S"]
        elif other_id.startswith(run_id + GROUP_ITEM):
            steps += _rank_steps(other)
            hosts.update((int(name[1:]), v["S"]) for name, v in other.items() if _HOST.fullmatch(name))
    last_step = max((s.step for s in steps), default=None)
    at_last = [s for s in steps if s.step == last_step]
    sizes = [s.world_size for s in at_last if s.world_size is not None]
    last_event = float(item["last_event"]["N"])
    created = number("created")
    return RunRecord(
        run_id=run_id,
        created=last_event if created is None else created,
        last_event=last_event,
        last_step=last_step,
        world_size=max(sizes) if sizes else None,
        ranks_reporting=None if last_step is None else len({s.rank for s in at_last if s.rank is not None}),
        finished=number("finished"),
        config=config,
        findings=text("findings"),
        findings_at=number("findings_at"),
        received=number("received"),
        watch=_unpack_watch(item["watch"]) if "watch" in item else None,
        headline=text("headline"),
        hosts=hosts or None,
    )


_HOST = re.compile(r"h\d+")  # a rank's host on its group's item


def _window(step_min: int, step_max: int | None) -> tuple[str, str]:
    """The sort-key range of a step window."""
    high = (10**_STEP_DIGITS - 1) if step_max is None else step_max
    return f"{step_min:0{_STEP_DIGITS}d}#", f"{high:0{_STEP_DIGITS}d}#\U0010ffff"


class DynamoTokenStore:
    """Tokens (``shared.tokens``) in the tokens table. The authorizer only reads (GetItem); operators
    create, list and revoke."""

    def __init__(self, table_name: str, client: DynamoDBClient | None = None) -> None:
        self.table_name = table_name
        self._client = client

    @property
    def client(self) -> DynamoDBClient:
        if self._client is None:
            import boto3

            self._client = boto3.client("dynamodb")
        return self._client

    def lookup(self, token: str) -> TokenRecord | None:
        """The record of a presented token, or None when it is unknown."""
        digest = token_hash(token)
        item = self.client.get_item(TableName=self.table_name, Key={HASH_KEY: {"S": digest}}).get("Item")
        if item is None or not hmac.compare_digest(item[HASH_KEY]["S"], digest):
            return None
        return _token_record(item)

    def create(
        self, project: str, description: str = "", token: str | None = None
    ) -> tuple[str, TokenRecord]:
        """Store a new token for ``project``; returns the token (shown once) and its record."""
        token_id = secrets.token_hex(4)
        if token is None:
            token, token_id = new_token()
        record = TokenRecord(token_id, project, time.time(), False, description)
        self.client.put_item(
            TableName=self.table_name,
            Item={
                HASH_KEY: {"S": token_hash(token)},
                "token_id": {"S": record.token_id},
                "project": {"S": record.project},
                "created": {"N": f"{record.created:.3f}"},
                "revoked": {"BOOL": False},
                "description": {"S": description},
            },
            ConditionExpression="attribute_not_exists(#h)",
            ExpressionAttributeNames={"#h": HASH_KEY},
        )
        return token, record

    def list(self, project: str | None = None) -> list[TokenRecord]:
        records = []
        for page in self.client.get_paginator("scan").paginate(TableName=self.table_name):
            records += [_token_record(item) for item in page.get("Items", [])]
        return sorted((r for r in records if project in (None, r.project)), key=lambda r: r.created)

    def revoke(self, token_id: str) -> bool:
        """Mark the token with this public id revoked; False when there is none."""
        for page in self.client.get_paginator("scan").paginate(
            TableName=self.table_name,
            FilterExpression="token_id = :id",
            ExpressionAttributeValues={":id": {"S": token_id}},
        ):
            for item in page.get("Items", []):
                self.client.update_item(
                    TableName=self.table_name,
                    Key={HASH_KEY: item[HASH_KEY]},
                    UpdateExpression="SET revoked = :true",
                    ExpressionAttributeValues={":true": {"BOOL": True}},
                )
                return True
        return False


def _token_record(item: dict[str, Any]) -> TokenRecord:
    return TokenRecord(
        token_id=item["token_id"]["S"],
        project=item["project"]["S"],
        created=float(item["created"]["N"]),
        revoked=bool(item.get("revoked", {}).get("BOOL", False)),
        description=item.get("description", {}).get("S", ""),
    )
