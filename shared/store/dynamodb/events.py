"""Rank events and scalars (``EventStore``, ``ScalarStore``): one conditional put per event, in its run's
16 shards (a scalar in its run's ``@scalars#`` partition), read back by step window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from instantml.limits import MAX_WORLD_SIZE
from shared.errors import EventIdReused, StoreThrottled, StoreUnavailable
from shared.store.dynamodb.base import PUT_CONCURRENCY, DynamoBase
from shared.store.dynamodb.errors import condition_failed, store_errors
from shared.store.dynamodb.layout.codecs import EVENT_PROJECTION, item_of, stored_event
from shared.store.dynamodb.layout.expressions import key_range_query
from shared.store.dynamodb.layout.keys import (
    PARTITION_KEY,
    SHARDS,
    SORT_KEY,
    partition_key,
    scalar_partition,
    step_of_sort_key,
    step_window,
)
from shared.store.port import EventPage, EventRows, Position, PutOutcome, RowsWanted, StoredEvent

if TYPE_CHECKING:
    from shared.events import Event, RankEvent, ScalarEvent

#: A batch stops starting puts after this long and answers 503, well inside the 29 s function timeout.
BATCH_DEADLINE_S = 20.0

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _put_pool() -> ThreadPoolExecutor:
    """One pool per process (a warm Lambda keeps it), created on the first batch."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=PUT_CONCURRENCY, thread_name_prefix="put")
        return _pool


class EventsMixin(DynamoBase):
    """Events and scalars in the metrics table."""

    #: The most events a summary reads one by one (``shared.summary.document``): botocore parses an item in
    #: tens of microseconds, so a summary stays within a few seconds of CPU at the function's memory.
    raw_read_budget = 25_000

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
                if not condition_failed(exc):
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

        def put(event: Event) -> PutOutcome | None:
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
        low, high = step_window(step_min, step_max)
        per_shard = None if max_items is None else max(1, max_items // SHARDS)

        def read(shard: int) -> tuple[list[StoredEvent], bool]:
            events: list[StoredEvent] = []
            pk = partition_key(project, run_id, shard)
            for event in self._query_shard(pk, low, high, None if per_shard is None else per_shard + 1):
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

    def read_event_rows(self, wanted: RowsWanted) -> EventRows:
        """One ``read_events`` from ``after``'s step (16 shard queries from its sort key on)."""
        return rows_after(self.read_events, wanted)

    def read_scalar_rows(self, wanted: RowsWanted) -> EventRows:
        """As ``read_event_rows``, from the run's scalar partition."""
        return rows_after(self.read_scalars, wanted)

    def next_step(self, project: str, run_id: str, step_min: int, step_max: int | None = None) -> int | None:
        """One item per shard (16 queries of ``Limit=1``): work follows the items, not the step range."""
        low, high = step_window(step_min, step_max)

        def first(shard: int) -> int | None:
            query = key_range_query(self.table_name, partition_key(project, run_id, shard), low, high)
            with store_errors("reads"):
                items = self.client.query(**query, ProjectionExpression="#sk", Limit=1).get("Items", [])
            return step_of_sort_key(items[0][SORT_KEY]["S"]) if items else None

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
        low, high = step_window(step_min, step_max)
        events: list[StoredEvent] = []
        pk = scalar_partition(project, run_id)
        for event in self._query_shard(pk, low, high, None if max_items is None else max_items + 1):
            events.append(event)
            if max_items is not None and len(events) > max_items:
                through = events[max_items].step - 1  # the last step may be cut: keep the steps before
                return EventPage([e for e in events if e.step <= through], through)
        return EventPage(events)

    def _query_shard(self, pk: str, low: str, high: str, wanted: int | None = None) -> Iterator[StoredEvent]:
        """One shard's events in the window; a throttling, failing or silent table raises 429/503. With
        ``wanted``, each query asks for that many items (``Limit``): a query is billed for the items it
        reads, and one of up to 1 MB would be paid whole for the few a capped read takes from it."""
        with store_errors("reads"):
            yield from self._read_shard(pk, low, high, wanted)

    def _read_shard(self, pk: str, low: str, high: str, wanted: int | None = None) -> Iterator[StoredEvent]:
        query = key_range_query(self.table_name, pk, low, high)
        paginator = self.client.get_paginator("query")
        if wanted is None:
            pages = paginator.paginate(**query, ProjectionExpression=EVENT_PROJECTION)
        else:
            pages = paginator.paginate(
                **query, ProjectionExpression=EVENT_PROJECTION, PaginationConfig={"PageSize": wanted}
            )
        for page in pages:
            for item in page.get("Items", []):
                yield stored_event(item)


def rows_after(read: Callable[..., EventPage], wanted: RowsWanted) -> EventRows:
    """``read_event_rows`` through a window read (``read_events`` or ``read_scalars``): one read of
    about ``max_items`` items from ``after``'s step, sorted, the events up to ``after`` dropped (at most
    one step's), and cut at ``max_items``; a read that the store cut at a step goes on after that step."""
    project, run_id, step_min, step_max, after, ranks, max_items = wanted
    start = step_min if after is None else max(step_min, after[0] + (after[1] >= MAX_WORLD_SIZE))
    if (step_max is not None and start > step_max) or (ranks is not None and not ranks):
        return EventRows([], [], [], [], [], [], [], None)
    page = read(project, run_id, start, step_max, max_items=max_items)
    if page.complete_through is not None and page.complete_through < start:
        # The first step alone holds more than ``max_items`` events (up to 512 ranks', spread over the
        # shards): read it whole, and give it whole (its 16 queries are paid; the page's budget holds).
        page = EventPage(read(project, run_id, start, start).events, start)
        max_items = len(page.events)
    events = sorted(
        (e for e in page.events if ranks is None or e.rank in ranks),
        key=lambda e: (e.step, e.rank, e.event_id),
    )
    if after is not None:
        events = [e for e in events if (e.step, e.rank, e.event_id) > after]
    resume: Position | None = None
    if len(events) > max_items:
        del events[max_items:]
        resume = (events[-1].step, events[-1].rank, events[-1].event_id)
    elif page.complete_through is not None and (step_max is None or page.complete_through < step_max):
        resume = (page.complete_through, MAX_WORLD_SIZE, "")
    return EventRows(
        [e.event_id for e in events],
        [e.step for e in events],
        [e.rank for e in events],
        [e.world_size for e in events],
        [e.local_rank for e in events],
        [e.keys for e in events],
        [e.packed for e in events],
        resume,
    )
