"""The store port on SQLite: one database file in WAL mode, for ``instantml local``.

Tables (created when missing):

- ``runs``: one row per (project, run_id), numbered, so the events' index holds an integer per run;
  it is also the run's record (``RunStore``): activity, last step and the ranks at it (a 64-byte bitmap),
  config, finished time and findings counts, updated as events arrive. ``runs_by_activity`` lists a
  project's runs newest first without reading events.
- ``events``: one row per rank event; ``v`` is the DynamoDB adapter's packed float64
  ``[weight, time, *values]`` (NaN and Infinity bit for bit), ``keys`` the metric keys joined by
  newlines, ``h`` the payload digest. The unique index on ``(run, step, event_id)`` is both the
  idempotency check and the window read: a run's events sit together in step order, so a read touches
  only the run asked for, and inserts land at the end of the index (steps grow with time) instead of at
  random places, which is what keeps them fast as the database grows. Like the DynamoDB layout (unique
  per run, shard and step), an id is unique per (run, step): a reused id with another step is stored
  as another event.
- ``scalars``: ``run.log`` events, laid out as ``events`` (``world_size`` 0).
- ``rollup_headers``, ``rollup_values``, ``rollup_marks``: the levels of rollups of ``shared.rollups``
  (rows of up to a few KB: ordinary tables with a unique index, since ``WITHOUT ROWID`` suits small
  rows), each write kept only when it read at least as many events as the stored one
  (``WHERE excluded.n >= n``). A database from before the levels has its one level (``rollup_blocks``)
  dropped and its change feed read again from the start, which rolls every run up anew.
- ``feed_cursors``: how far a reader of the change feed (``read_changes``: the events table in
  ``rowid`` order; a duplicate inserts nothing, so it is no change) has got, kept across restarts.
- ``tokens``: API tokens by SHA-256 (``shared.tokens``).

Durability: WAL with ``synchronous=NORMAL`` keeps every committed transaction through a killed
process (SIGKILL included); a batch is committed before it is answered. Writers queue on SQLite's lock
for up to ``BUSY_TIMEOUT_S``, then the request is answered 429 with ``Retry-After``.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import EventIdReused, StoreThrottled, StoreUnavailable
from shared.rollups import BlockHeader, RolledBlock, unpack_header
from shared.store import ROLLUP_FEED
from shared.store.port import (
    Delivery,
    EventPage,
    PendingDelivery,
    PutOutcome,
    RollupProgress,
    RunActivity,
    RunRecord,
    RunStatus,
    StoredEvent,
    Webhook,
)
from shared.tokens import TokenRecord, new_token, token_hash

BUSY_TIMEOUT_S = 10.0

if TYPE_CHECKING:
    from shared.events import Event, RankEvent, ScalarEvent


SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, project TEXT NOT NULL, run_id TEXT NOT NULL, UNIQUE (project, run_id));
CREATE TABLE IF NOT EXISTS events (
    run INTEGER NOT NULL, step INTEGER NOT NULL, event_id TEXT NOT NULL, rank INTEGER NOT NULL,
    world_size INTEGER NOT NULL, local_rank INTEGER, keys TEXT NOT NULL, v BLOB NOT NULL, h BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS events_by_step ON events (run, step, event_id);
CREATE TABLE IF NOT EXISTS scalars (
    run INTEGER NOT NULL, step INTEGER NOT NULL, event_id TEXT NOT NULL, rank INTEGER NOT NULL,
    world_size INTEGER NOT NULL, local_rank INTEGER, keys TEXT NOT NULL, v BLOB NOT NULL, h BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS scalars_by_step ON scalars (run, step, event_id);
CREATE TABLE IF NOT EXISTS rollup_headers (
    run INTEGER NOT NULL, size INTEGER NOT NULL, block INTEGER NOT NULL, n INTEGER NOT NULL, h BLOB NOT NULL,
    keys TEXT NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS rollup_headers_by_block ON rollup_headers (run, size, block);
CREATE TABLE IF NOT EXISTS rollup_values (
    run INTEGER NOT NULL, key TEXT NOT NULL, size INTEGER NOT NULL, block INTEGER NOT NULL,
    n INTEGER NOT NULL, v BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS rollup_values_by_block ON rollup_values (run, key, size, block);
CREATE TABLE IF NOT EXISTS rollup_marks (run INTEGER PRIMARY KEY, step INTEGER NOT NULL, nodes BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS feed_cursors (name TEXT PRIMARY KEY, position INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    token_hash TEXT PRIMARY KEY, token_id TEXT NOT NULL, project TEXT NOT NULL, created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0, description TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS alert_hooks (project TEXT PRIMARY KEY, webhooks TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    id TEXT PRIMARY KEY, project TEXT NOT NULL, url TEXT NOT NULL, payload TEXT NOT NULL,
    created REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL,
    last_error TEXT, dead INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (dead, next_at);
"""

#: The columns of an event in StoredEvent's order: each row becomes one with no per-field Python.
_SELECT_WINDOW = (
    "SELECT event_id, step, rank, world_size, keys, v, local_rank FROM events"
    " WHERE run = ? AND step BETWEEN ? AND ? ORDER BY step"
)
_SELECT_SCALARS = (
    "SELECT event_id, step, rank, world_size, keys, v, local_rank FROM scalars"
    " WHERE run = ? AND step BETWEEN ? AND ? ORDER BY step"
)
_SELECT_SINCE = (
    "SELECT event_id, step, rank, world_size, keys, v, local_rank FROM events"
    " WHERE rowid > ? AND run = ? AND step BETWEEN ? AND ?"
)
#: At most this many events of recently read windows are kept, per store (about 36 MB).
WINDOW_CACHE_EVENTS = 100_000
_new_event = functools.partial(tuple.__new__, StoredEvent)


def _stored_events(rows: list[tuple[Any, ...]]) -> list[StoredEvent]:
    if not rows:
        return []
    ids, steps, ranks, sizes, joined, packed, local = zip(*rows, strict=True)
    # Events with the same keys share one list (the summary maps each distinct list once).
    split = {keys: keys.split("\n") for keys in dict.fromkeys(joined)}
    key_lists = [split[keys] for keys in joined]
    return list(map(_new_event, zip(ids, steps, ranks, sizes, key_lists, packed, local, strict=True)))


#: A change of the feed: (project, run_id, step) of a newly stored event.
Change = tuple[str, str, int]


def _window_page(
    conn: sqlite3.Connection, select: str, run: int, low: int, high: int, max_items: int | None
) -> EventPage:
    """The rows of ``select`` (a window's) as events; with ``max_items``, cut after the last whole step."""
    sql, params = select, [run, low, high]
    if max_items is not None:
        sql += " LIMIT ?"
        params.append(max_items + 1)
    rows = conn.execute(sql, params).fetchall()
    if max_items is not None and len(rows) > max_items:
        through = rows[max_items][1] - 1  # the last step may be cut: keep the steps before it
        return EventPage(_stored_events([row for row in rows if row[1] <= through]), through)
    return EventPage(_stored_events(rows))


class SqliteDatabase:
    """One database file, one connection per thread (SQLite connections are not shared)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._runs: dict[tuple[str, str], int] = {}
        with self.errors("opening the database"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = self.connection()
            _drop_single_level_rollups(conn)
            conn.executescript(SCHEMA)
            _add_run_columns(conn)
            conn.execute("CREATE INDEX IF NOT EXISTS runs_by_received ON runs (received)")

    def connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """A database that stays locked becomes 429, any other failure of SQLite 503 (both retryable);
        a damaged file says so and what to do, since retrying will not mend it."""
        try:
            yield
        except sqlite3.DatabaseError as exc:  # OperationalError included
            if getattr(exc, "sqlite_errorcode", None) in _DAMAGED:
                raise StoreUnavailable(
                    f"the local database {self.path} is damaged ({exc}) and failed {doing}; stop `instantml "
                    "local`, then move the file aside or restore it from a backup, or start with another "
                    "--data-dir"
                ) from None
            if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
                raise StoreThrottled(f"the local database is busy {doing}; retry shortly") from None
            raise StoreUnavailable(f"the local database failed {doing} ({exc}); retry shortly") from None

    @contextmanager
    def write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (``BEGIN IMMEDIATE``), committed or rolled back."""
        with self.errors(doing):
            conn = self.connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def run_key(self, conn: sqlite3.Connection, project: str, run_id: str, create: bool) -> int | None:
        """The number of a run (made inside the caller's write transaction when ``create``)."""
        found = self._runs.get((project, run_id))
        if found is not None:
            return found
        row = conn.execute(
            "SELECT id FROM runs WHERE project = ? AND run_id = ?", (project, run_id)
        ).fetchone()
        if row is None and create:
            # Not cached: the caller's transaction may still roll back and give the number to the
            # next run made. Only numbers read from committed rows are cached.
            (made,) = conn.execute(
                "INSERT INTO runs (project, run_id) VALUES (?, ?) RETURNING id", (project, run_id)
            ).fetchone()
            return int(made)
        if row is None:
            return None
        self._runs[(project, run_id)] = int(row[0])
        return int(row[0])

    def new_run_key(self, conn: sqlite3.Connection, project: str, run_id: str) -> int:
        """The number of a run, made (inside the caller's write transaction) when it is new."""
        key = self.run_key(conn, project, run_id, create=True)
        assert key is not None
        return key

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


class SqliteStore:
    """Events, rollups and the change feed in one SQLite database (see the module's docstring)."""

    #: Every note's time is recorded as it comes: a run's row costs microseconds to rewrite (``RunStore``).
    run_time_resolution_s = 0.0

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        """``clock`` is the server's: when a run's events are received (tests and replays set it)."""
        self.db = SqliteDatabase(path)
        self.clock = clock
        self._windows: OrderedDict[tuple[int, int, int], tuple[int, list[StoredEvent]]] = OrderedDict()
        self._windows_lock = threading.Lock()

    # Events

    def put_events(self, events: list[RankEvent]) -> list[PutOutcome]:
        """One write transaction for the batch: the ids already stored are read in one query, the new
        events inserted with one ``executemany`` (a duplicate never writes)."""
        return self._put("events", events)

    def put_scalars(self, events: list[ScalarEvent]) -> list[PutOutcome]:
        return self._put("scalars", events)

    def _put(self, table: str, events: Sequence[Event]) -> list[PutOutcome]:
        if not events:
            return []
        with self.db.write(f"storing {table}") as conn:
            runs = {
                pair: self.db.new_run_key(conn, *pair) for pair in {(e.project, e.run_id) for e in events}
            }
            stored = self._stored_digests(conn, table, runs, events)
            outcomes: list[PutOutcome] = []
            rows = []
            for event in events:
                run = runs[(event.project, event.run_id)]
                key = (run, event.step, event.event_id)
                digest = stored.get(key)
                if digest is None:
                    stored[key] = event.payload_digest
                    outcomes.append("stored")
                    packed = struct.pack(
                        f"<{2 + len(event.values)}d", event.weight, event.time, *event.values
                    )
                    keys = "\n".join(event.keys)
                    row = (event.step, event.event_id, event.rank, event.world_size, event.local_rank, keys)
                    rows.append((run, *row, packed, event.payload_digest))
                elif digest == event.payload_digest:
                    outcomes.append("duplicate")
                else:
                    outcomes.append(
                        EventIdReused(f"event {event.event_id!r} is already stored with a different payload")
                    )
            conn.executemany(
                f"INSERT INTO {table} (run, step, event_id, rank, world_size, local_rank, keys, v, h)"  # noqa: S608 - a constant
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        return outcomes

    @staticmethod
    def _stored_digests(
        conn: sqlite3.Connection, table: str, runs: dict[tuple[str, str], int], events: Sequence[Event]
    ) -> dict[tuple[int, int, str], bytes]:
        """The digests of the batch's ids already stored, by (run, step, event_id): one exact index
        lookup per step of the batch (a batch holds a few steps), inside the write transaction."""
        wanted: dict[tuple[int, int], set[str]] = {}
        for e in events:
            wanted.setdefault((runs[(e.project, e.run_id)], e.step), set()).add(e.event_id)
        found: dict[tuple[int, int, str], bytes] = {}
        for (run, step), id_set in wanted.items():
            ids = sorted(id_set)
            for i in range(0, len(ids), _IDS_PER_QUERY):
                chunk = ids[i : i + _IDS_PER_QUERY]
                placeholders = ", ".join("?" * len(chunk))  # only placeholders are formatted in
                sql = f"SELECT event_id, h FROM {table} WHERE run = ? AND step = ? AND event_id IN "  # noqa: S608
                rows = conn.execute(f"{sql}({placeholders})", (run, step, *chunk))
                for event_id, digest in rows:
                    found[(run, step, event_id)] = digest
        return found

    def read_events(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """A window's events. Windows read whole are kept (``WINDOW_CACHE_EVENTS`` events at most, the
        least recently read dropped first): stored events never change, so a window read again costs
        one query for the rows stored since (the tab asks every few seconds for a live run)."""
        high = _MAX_SQL_INT if step_max is None else step_max
        with self.db.errors("reading events"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return EventPage([])
            conn.execute("BEGIN")  # one snapshot: the rows up to ``newest`` are all there is
            try:
                newest = conn.execute("SELECT max(rowid) FROM events").fetchone()[0] or 0
                window = (run, step_min, high)
                with self._windows_lock:
                    cached = self._windows.get(window)
                if cached is not None and cached[0] <= newest:
                    events = cached[1]
                    if cached[0] < newest:  # only the rows stored since, a range of the table's rowids
                        rows = conn.execute(
                            _SELECT_SINCE,
                            (cached[0], run, step_min, high),
                        ).fetchall()
                        events = events + _stored_events(rows)
                    if max_items is None or len(events) <= max_items:
                        self._keep(window, newest, events)
                        return EventPage(list(events))
                page = _window_page(conn, _SELECT_WINDOW, run, step_min, high, max_items)
            finally:
                conn.execute("COMMIT")
        if page.complete_through is not None:
            return page
        self._keep(window, newest, page.events)
        return EventPage(list(page.events))

    def _keep(self, window: tuple[int, int, int], newest: int, events: list[StoredEvent]) -> None:
        with self._windows_lock:
            self._windows.pop(window, None)
            if len(events) > WINDOW_CACHE_EVENTS:
                return
            self._windows[window] = (newest, events)
            total = sum(len(e) for _, e in self._windows.values())
            while total > WINDOW_CACHE_EVENTS:
                _, (_, dropped) = self._windows.popitem(last=False)
                total -= len(dropped)

    def next_step(self, project: str, run_id: str, step_min: int, step_max: int | None = None) -> int | None:
        with self.db.errors("reading events"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return None
            row = conn.execute(
                "SELECT min(step) FROM events WHERE run = ? AND step BETWEEN ? AND ?",
                (run, step_min, _MAX_SQL_INT if step_max is None else step_max),
            ).fetchone()
        return None if row[0] is None else int(row[0])

    def read_scalars(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """A window's scalar events (a run logs one per step or so: read each time, not kept)."""
        high = _MAX_SQL_INT if step_max is None else step_max
        with self.db.errors("reading scalars"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return EventPage([])
            return _window_page(
                conn,
                _SELECT_SCALARS,
                run,
                step_min,
                high,
                max_items,
            )

    # Run records

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        with self.db.write("recording the run's activity") as conn:
            run = self.db.new_run_key(conn, project, run_id)
            created, last_event, last_step, ranks, world_size = conn.execute(
                "SELECT created, last_event, last_step, ranks, world_size FROM runs WHERE id = ?", (run,)
            ).fetchone()
            bits = int.from_bytes(ranks or b"", "little")
            if activity.step is not None:
                new = sum(1 << rank for rank in activity.ranks)
                if last_step is None or activity.step > last_step:
                    last_step, bits, world_size = activity.step, new, activity.world_size
                elif activity.step == last_step:
                    bits |= new
                    world_size = max(world_size or 0, activity.world_size or 0) or None
            conn.execute(
                "UPDATE runs SET created = ?, last_event = ?, last_step = ?, ranks = ?, world_size = ?,"
                " received = max(coalesce(received, 0), ?) WHERE id = ?",
                (
                    activity.time if created is None else created,
                    activity.time if last_event is None else max(last_event, activity.time),
                    last_step,
                    None if last_step is None else bits.to_bytes(_RANK_BITMAP_BYTES, "little"),
                    world_size,
                    self.clock(),
                    run,
                ),
            )

    def update_run(
        self,
        project: str,
        run_id: str,
        time: float,
        config: str | None = None,
        finished: bool = False,
        hosts: dict[int, str] | None = None,
    ) -> RunRecord:
        with self.db.write("updating the run") as conn:
            run = self.db.new_run_key(conn, project, run_id)
            if hosts:  # merged with the ranks' hosts already kept (in the write's transaction)
                (kept,) = conn.execute("SELECT hosts FROM runs WHERE id = ?", (run,)).fetchone()
                merged = {**json.loads(kept or "{}"), **{str(rank): host for rank, host in hosts.items()}}
                conn.execute("UPDATE runs SET hosts = ? WHERE id = ?", (json.dumps(merged), run))
            conn.execute(
                "UPDATE runs SET created = coalesce(created, :time),"
                " last_event = max(coalesce(last_event, :time), :time), config = coalesce(:config, config),"
                " finished = CASE WHEN :finished THEN coalesce(finished, :time) ELSE finished END,"
                " received = max(coalesce(received, 0), :now) WHERE id = :run",
                {"time": time, "config": config, "finished": finished, "run": run, "now": self.clock()},
            )
        record = self.get_run(project, run_id)
        assert record is not None
        return record

    def note_findings(self, project: str, run_id: str, findings: str, at: float) -> None:
        with self.db.write("recording the run's findings") as conn:
            conn.execute(
                "UPDATE runs SET findings = ?, findings_at = ? WHERE project = ? AND run_id = ?"
                " AND last_event IS NOT NULL AND (findings_at IS NULL OR findings_at <= ?)",
                (findings, at, project, run_id, at),
            )

    def get_run(self, project: str, run_id: str) -> RunRecord | None:
        with self.db.errors("reading the run"):
            row = (
                self.db.connection()
                .execute(
                    _SELECT_RUN + " WHERE project = ? AND run_id = ? AND last_event IS NOT NULL",
                    (project, run_id),
                )
                .fetchone()
            )
        return None if row is None else _run_record(row)

    def list_runs(
        self,
        project: str,
        limit: int,
        after: tuple[float, str] | None = None,
        statuses: frozenset[RunStatus] | None = None,
        idle_before: float = 0.0,
    ) -> list[RunRecord]:
        where = ["project = ?", "last_event IS NOT NULL"]
        params: list[Any] = [project]
        if after is not None:
            where.append("(last_event, run_id) < (?, ?)")
            params += after
        if statuses is not None:
            alternatives = []
            for status in sorted(statuses):
                alternatives.append(_STATUS_SQL[status])
                params += [idle_before] if status != "finished" else []
            where.append("(" + " OR ".join(alternatives or ["0"]) + ")")
        sql = _SELECT_RUN + " WHERE " + " AND ".join(where)  # only constants are joined in
        with self.db.errors("listing runs"):
            rows = self.db.connection().execute(
                sql + " ORDER BY last_event DESC, run_id DESC LIMIT ?", (*params, limit)
            )
            return [_run_record(row) for row in rows]

    # The watch (shared.watch) and its alerts

    def watched_runs(self, received_after: float, limit: int) -> list[tuple[str, RunRecord]]:
        with self.db.errors("listing the runs to watch"):
            rows = self.db.connection().execute(
                "SELECT project, "
                + _SELECT_RUN.removeprefix("SELECT ")
                + " WHERE received >= ? AND last_event IS NOT NULL ORDER BY received DESC LIMIT ?",
                (received_after, limit),
            )
            return [(row[0], _run_record(row[1:])) for row in rows]

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
        """The round's result and its deliveries in one transaction: a crash keeps both or neither, so
        an alert is queued exactly once per decision."""
        with self.db.write("recording the watch") as conn:
            conn.execute(
                "UPDATE runs SET watch = ?, findings = ?, findings_at = ?, headline = ?"
                " WHERE project = ? AND run_id = ?",
                (state, counts, at, headline, project, run_id),
            )
            conn.executemany(
                "INSERT OR IGNORE INTO outbox (id, project, url, payload, created, next_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (d.delivery_id, d.project, d.url, json.dumps(d.payload, separators=(",", ":")), at, at)
                    for d in deliveries
                ],
            )

    def due_deliveries(self, now: float, limit: int) -> list[PendingDelivery]:
        with self.db.errors("reading the alerts to send"):
            rows = self.db.connection().execute(
                "SELECT id, project, url, payload, created, attempts FROM outbox"
                " WHERE dead = 0 AND next_at <= ? ORDER BY next_at LIMIT ?",
                (now, limit),
            )
            return [PendingDelivery(Delivery(r[0], r[1], r[2], json.loads(r[3])), r[4], r[5]) for r in rows]

    def pending_deliveries(self) -> int:
        with self.db.errors("counting the alerts to send"):
            (n,) = self.db.connection().execute("SELECT count(*) FROM outbox WHERE dead = 0").fetchone()
        return int(n)

    def delivery_done(self, delivery_id: str) -> None:
        with self.db.write("recording a sent alert") as conn:
            conn.execute("DELETE FROM outbox WHERE id = ?", (delivery_id,))

    def delivery_failed(self, delivery_id: str, error: str, next_at: float | None) -> None:
        """Try again at ``next_at``; None gives up (the row stays, marked dead, for a person to see)."""
        with self.db.write("recording a failed alert") as conn:
            conn.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?, next_at = coalesce(?, next_at),"
                " dead = ? WHERE id = ?",
                (error[:500], next_at, next_at is None, delivery_id),
            )

    def get_webhooks(self, project: str) -> list[Webhook]:
        with self.db.errors("reading the project's alerts"):
            row = (
                self.db.connection()
                .execute("SELECT webhooks FROM alert_hooks WHERE project = ?", (project,))
                .fetchone()
            )
        return [] if row is None else [Webhook(**hook) for hook in json.loads(row[0])]

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        text = json.dumps([asdict(hook) for hook in webhooks], separators=(",", ":"))
        with self.db.write("saving the project's alerts") as conn:
            conn.execute(
                "INSERT INTO alert_hooks (project, webhooks) VALUES (?, ?)"
                " ON CONFLICT (project) DO UPDATE SET webhooks = excluded.webhooks",
                (project, text),
            )

    def delete_webhooks(self, project: str) -> bool:
        with self.db.write("removing the project's alerts") as conn:
            return conn.execute("DELETE FROM alert_hooks WHERE project = ?", (project,)).rowcount > 0

    # Rollups

    def read_blocks(self, project: str, run_id: str, size: int, first: int, last: int) -> list[BlockHeader]:
        with self.db.errors("reading rollups"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return []
            rows = conn.execute(
                "SELECT block, h, keys FROM rollup_headers"
                " WHERE run = ? AND size = ? AND block BETWEEN ? AND ? ORDER BY block",
                (run, size, first, min(last, _MAX_SQL_INT)),
            ).fetchall()
        return [unpack_header(size, block, h, keys.split("\n")) for block, h, keys in rows]

    def read_block_sums(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        sums: dict[str, dict[int, bytes]] = {key: {} for key in keys}
        with self.db.errors("reading rollups"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return sums
            for key in keys:
                rows = conn.execute(
                    "SELECT block, v FROM rollup_values"
                    " WHERE run = ? AND key = ? AND size = ? AND block BETWEEN ? AND ?",
                    (run, key, size, first, min(last, _MAX_SQL_INT)),
                )
                sums[key] = dict(rows)
        return sums

    def write_blocks(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        with self.db.write("writing rollups") as conn:
            run = self.db.new_run_key(conn, project, run_id)
            for block in rolled:
                h = block.header
                conn.executemany(
                    "INSERT INTO rollup_values (run, key, size, block, n, v) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT DO UPDATE SET n = excluded.n, v = excluded.v WHERE excluded.n >= n",
                    [(run, key, h.size, h.block, h.n_events, v) for key, v in block.sums.items()],
                )
                conn.execute(
                    "INSERT INTO rollup_headers (run, size, block, n, h, keys) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT DO UPDATE SET n = excluded.n, h = excluded.h, keys = excluded.keys"
                    " WHERE excluded.n >= n",
                    (run, h.size, h.block, h.n_events, h.packed(), "\n".join(h.keys)),
                )

    def rollup_progress(self, project: str, run_id: str) -> RollupProgress:
        with self.db.errors("reading rollups"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            if run is None:
                return RollupProgress()
            row = conn.execute("SELECT step, nodes FROM rollup_marks WHERE run = ?", (run,)).fetchone()
        return RollupProgress() if row is None else RollupProgress(int(row[0]), bytes(row[1]))

    def late_steps(self, project: str, run_id: str, step_min: int, step_max: int, limit: int) -> list[int]:
        """The events the rollup worker has not read yet (after its feed position: its backlog, seconds of
        ingest at most) at steps it has rolled up already. None where no worker reads the feed (the
        rollups are then made by whoever calls ``roll_up``, from every event there is)."""
        with self.db.errors("reading events"):
            conn = self.db.connection()
            run = self.db.run_key(conn, project, run_id, create=False)
            cursor = conn.execute(
                "SELECT position FROM feed_cursors WHERE name = ?", (ROLLUP_FEED,)
            ).fetchone()
            if run is None or cursor is None:
                return []
            # The backlog by rowid, never the window's rows by the (run, step) index: `+` keeps the
            # planner off that index, which would read every event of a whole-run window.
            rows = conn.execute(
                "SELECT DISTINCT step FROM events WHERE rowid > ? AND +run = ? AND +step BETWEEN ? AND ?"
                " ORDER BY step LIMIT ?",
                (cursor[0], run, step_min, step_max, limit),
            ).fetchall()
        return [int(row[0]) for row in rows]

    def advance_rollups(self, project: str, run_id: str, step: int, nodes: bytes) -> None:
        with self.db.write("writing rollups") as conn:
            run = self.db.new_run_key(conn, project, run_id)
            conn.execute(
                "INSERT INTO rollup_marks (run, step, nodes) VALUES (?, ?, ?)"
                " ON CONFLICT DO UPDATE SET step = max(step, excluded.step), nodes = excluded.nodes",
                (run, step, nodes),
            )

    # The change feed (what the stream is to DynamoDB)

    def read_changes(self, after: int, limit: int) -> tuple[list[Change], int]:
        """Events stored after position ``after``, oldest first, at most ``limit``; and the new position."""
        with self.db.errors("reading changes"):
            rows = (
                self.db.connection()
                .execute(
                    "SELECT e.rowid, r.project, r.run_id, e.step FROM events e JOIN runs r ON r.id = e.run"
                    " WHERE e.rowid > ? ORDER BY e.rowid LIMIT ?",
                    (after, limit),
                )
                .fetchall()
            )
        return [(project, run_id, step) for _, project, run_id, step in rows], (
            rows[-1][0] if rows else after
        )

    def feed_position(self, name: str) -> int:
        with self.db.errors("reading changes"):
            row = (
                self.db.connection()
                .execute("SELECT position FROM feed_cursors WHERE name = ?", (name,))
                .fetchone()
            )
        return 0 if row is None else int(row[0])

    def save_feed_position(self, name: str, position: int) -> None:
        with self.db.write("saving the change feed's position") as conn:
            conn.execute(
                "INSERT INTO feed_cursors (name, position) VALUES (?, ?)"
                " ON CONFLICT DO UPDATE SET position = excluded.position WHERE excluded.position > position",
                (name, position),
            )


class SqliteTokenStore:
    """API tokens (``shared.tokens``) in the same database."""

    #: The authorizer's cache TTL (``shared.tokens.TokenCache``): none. A lookup is one primary-key read
    #: of a local file (about 10 us) on one connection kept for lookups (an HTTP connection is a thread
    #: of its own; a connection per thread would be opened per request), so each request sees the table
    #: as committed: `instantml tokens revoke` takes effect at the next request.
    cache_ttl_s = 0.0

    def __init__(self, path: str | Path) -> None:
        self.db = SqliteDatabase(path)
        self._lookups: sqlite3.Connection | None = None
        self._lookups_lock = threading.Lock()

    def lookup(self, token: str) -> TokenRecord | None:
        with self.db.errors("reading tokens"), self._lookups_lock:
            if self._lookups is None:
                self._lookups = sqlite3.connect(
                    self.db.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
                )
            row = self._lookups.execute(
                "SELECT token_id, project, created, revoked, description FROM tokens WHERE token_hash = ?",
                (token_hash(token),),
            ).fetchone()
        return None if row is None else TokenRecord(row[0], row[1], row[2], bool(row[3]), row[4])

    def create(
        self, project: str, description: str = "", token: str | None = None
    ) -> tuple[str, TokenRecord]:
        if token is None:
            token, token_id = new_token()
        else:
            token_id = token_hash(token)[:8]
        record = TokenRecord(token_id, project, time.time(), False, description)
        with self.db.write("storing a token") as conn:
            conn.execute(
                "INSERT INTO tokens (token_hash, token_id, project, created, description)"
                " VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                (token_hash(token), token_id, project, record.created, description),
            )
        found = self.lookup(token)
        assert found is not None
        return token, found

    def list(self, project: str | None = None) -> list[TokenRecord]:
        with self.db.errors("reading tokens"):
            rows = self.db.connection().execute(
                "SELECT token_id, project, created, revoked, description FROM tokens ORDER BY created"
            )
            records = [TokenRecord(r[0], r[1], r[2], bool(r[3]), r[4]) for r in rows]
        return [r for r in records if project in (None, r.project)]

    def revoke(self, token_id: str) -> bool:
        with self.db.write("revoking a token") as conn:
            changed = conn.execute("UPDATE tokens SET revoked = 1 WHERE token_id = ?", (token_id,)).rowcount
        return changed > 0


_MAX_SQL_INT = 2**63 - 1
#: SQLITE_CORRUPT and SQLITE_NOTADB: the file is damaged, and no retry mends it.
_DAMAGED = (11, 26)
_HEADER = b"SQLite format 3\x00"


def check_database(path: str | Path, budget_s: float) -> tuple[str | None, bool]:
    """What is wrong with the database file at ``path`` (None if nothing was found), and whether the
    check covered all of it.

    First what costs nothing: SQLite's header, a whole number of pages, and (with no write-ahead log
    pending, which could hold the missing pages) no fewer pages than the header counts. Then SQLite's
    ``PRAGMA quick_check`` (every page of every b-tree, not index contents), stopped after ``budget_s``:
    it reads the whole file, about 1.5 s per 500 MB from the page cache and far more from a cold disk,
    so a large database is only partly checked within the budget (``complete`` false).
    """
    path = Path(path)
    size = path.stat().st_size
    wal = path.with_name(path.name + "-wal")
    wal_pending = wal.exists() and wal.stat().st_size > 0
    with open(path, "rb") as f:
        header = f.read(100)
    if size == 0 and not wal_pending:
        return None, True  # an empty file: SQLite makes a new database in it
    if size > 0 or not wal_pending:
        if len(header) < 100 or not header.startswith(_HEADER):
            return (
                "it does not begin with SQLite's header: it is not a database, or its first page is "
                "overwritten",
                True,
            )
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        if page_size < 512 or page_size & (page_size - 1):
            return f"its header gives an impossible page size ({page_size})", True
        if size % page_size:
            return (
                f"its size ({size} bytes) is not a whole number of {page_size}-byte pages: it was cut short",
                True,
            )
        pages = int.from_bytes(header[28:32], "big")
        counted = header[24:28] == header[92:96] and pages > 0  # the header's page count is current
        if counted and not wal_pending and pages * page_size > size:
            return (
                f"it holds {size} bytes where its header counts {pages * page_size}: it was cut short",
                True,
            )
    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, check_same_thread=False)
    timer = threading.Timer(budget_s, conn.interrupt)
    timer.start()
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorcode", None) == 9:  # SQLITE_INTERRUPT: the budget ran out
            return None, False
        return str(exc), True
    finally:
        timer.cancel()
        conn.close()
    if rows != ["ok"]:
        lines = [line for row in rows for line in row.splitlines() if not line.startswith("***")]
        return "; ".join(lines), True
    return None, True


#: Events stored last that a database made before run records is searched for its runs' latest time.
_LATEST_ROWS = 1000
#: The ranks at a run's last step, one bit per rank (world sizes are at most 512).
_RANK_BITMAP_BYTES = 64
_RUN_COLUMNS = {
    "created": "REAL",
    "last_event": "REAL",
    "last_step": "INTEGER",
    "world_size": "INTEGER",
    "ranks": "BLOB",
    "finished": "REAL",
    "config": "TEXT",
    "findings": "TEXT",
    "findings_at": "REAL",
    "received": "REAL",  # the server's clock when the run's last event or update was received
    "watch": "TEXT",  # the watch's state (shared.watch.WatchState as JSON)
    "headline": "TEXT",  # the worst finding in a few words ("rank 5 stopped")
    "hosts": "TEXT",  # a JSON object: rank -> host
}
_SELECT_RUN = (
    "SELECT run_id, created, last_event, last_step, world_size, ranks, finished, config, findings,"
    " findings_at, received, watch, headline, hosts FROM runs"
)
_STATUS_SQL = {
    "finished": "finished IS NOT NULL",
    "live": "(finished IS NULL AND last_event >= ?)",
    "idle": "(finished IS NULL AND last_event < ?)",
}


def _run_record(row: tuple[Any, ...]) -> RunRecord:
    run_id, created, last_event, last_step, world_size, ranks, finished, config, findings, findings_at = row[
        :10
    ]
    received, watch, headline, hosts = row[10:]
    return RunRecord(
        run_id=run_id,
        created=created,
        last_event=last_event,
        last_step=last_step,
        world_size=world_size,
        ranks_reporting=None if ranks is None else int.from_bytes(ranks, "little").bit_count(),
        finished=finished,
        config=config,
        findings=findings,
        findings_at=findings_at,
        received=received,
        watch=watch,
        headline=headline,
        hosts=None if hosts is None else {int(rank): host for rank, host in json.loads(hosts).items()},
    )


def _drop_single_level_rollups(conn: sqlite3.Connection) -> None:
    """A database from before the levels of rollups kept one level of 100-step blocks: drop it and read
    the change feed again from the start (every feed reader starts over), so that the rollup worker
    builds every level of every run from the stored events. Rollups are derived: nothing is lost, and
    summaries read events until the rebuild has passed them."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'rollup_blocks'").fetchone():
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table in ("rollup_blocks", "rollup_sums", "rollup_progress"):
            conn.execute(f"DROP TABLE IF EXISTS {table}")  # only constants formatted in
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'feed_cursors'").fetchone():
            conn.execute("DELETE FROM feed_cursors")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _add_run_columns(conn: sqlite3.Connection) -> None:
    """Give a database made before run records its ``runs`` columns, filled from the stored events
    once (what ``note_activity`` would have recorded), and the index that lists runs."""
    if set(_RUN_COLUMNS) <= {row[1] for row in conn.execute("PRAGMA table_info(runs)")}:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}  # another process may have
        for name, kind in _RUN_COLUMNS.items():
            if name not in have:
                conn.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")  # only constants formatted in
        runs = conn.execute("SELECT id FROM runs WHERE last_event IS NULL").fetchall()
        for (run,) in runs:
            (last_step,) = conn.execute("SELECT max(step) FROM events WHERE run = ?", (run,)).fetchone()
            if last_step is None:
                continue
            rows = conn.execute(
                "SELECT rank, world_size, v FROM events WHERE run = ? AND step = ?", (run, last_step)
            ).fetchall()
            first = conn.execute(
                "SELECT v FROM events WHERE run = ? ORDER BY step LIMIT 1", (run,)
            ).fetchone()
            # The latest time is at the last step, or among the events stored last (a late rank's).
            latest = conn.execute(
                "SELECT v FROM events WHERE run = ? ORDER BY rowid DESC LIMIT ?", (run, _LATEST_ROWS)
            ).fetchall()
            packed = [v for _, _, v in rows] + [v for (v,) in latest]
            last_event = max(struct.unpack_from("<d", v, 8)[0] for v in packed)
            bits = sum(1 << rank for rank, _, _ in rows)
            conn.execute(
                "UPDATE runs SET created = ?, last_event = ?, last_step = ?, ranks = ?, world_size = ?"
                " WHERE id = ?",
                (
                    min(struct.unpack_from("<d", first[0], 8)[0], last_event),
                    last_event,
                    last_step,
                    bits.to_bytes(_RANK_BITMAP_BYTES, "little"),
                    max(size for _, size, _ in rows),
                    run,
                ),
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute(
        "CREATE INDEX IF NOT EXISTS runs_by_activity ON runs (project, last_event DESC, run_id DESC)"
    )


#: Bound parameters per query stay well below SQLite's limit (32,766 since 3.32; 999 before).
_IDS_PER_QUERY = 900
