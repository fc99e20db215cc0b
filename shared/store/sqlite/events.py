"""Rank events and ``run.log`` scalars (``EventStore``, ``ScalarStore``): the ``events`` and ``scalars``
tables, stored a batch per transaction and read a window at a time, with recently read windows kept."""

from __future__ import annotations

import sqlite3
import struct
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from instantml.limits import MAX_WORLD_SIZE
from shared.errors import EventIdReused
from shared.store.port import EventPage, EventRows, PutOutcome, RowsWanted, StoredEvent
from shared.store.sqlite.codecs import event_rows, stored_events
from shared.store.sqlite.database import MAX_SQL_INT, SqliteDatabase

if TYPE_CHECKING:
    from collections.abc import Sequence

    from shared.events import Event, RankEvent, ScalarEvent

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
#: A raw read (contract 9): the events after a position, in (step, rank, event_id) order; the step
#: range comes first so that the index seeks to the position's step, whatever the run's length.
_SELECT_ROWS = (
    "SELECT event_id, step, rank, world_size, keys, v, local_rank FROM {table}"
    " WHERE run = ? AND step BETWEEN ? AND ? AND (step, rank, event_id) > (?, ?, ?){ranks}"
    " ORDER BY step, rank, event_id LIMIT ?"
)
#: At most this many events of recently read windows are kept, per store (about 36 MB).
WINDOW_CACHE_EVENTS = 100_000
#: Bound parameters per query stay well below SQLite's limit (32,766 since 3.32; 999 before).
_IDS_PER_QUERY = 900


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
        return EventPage(stored_events([row for row in rows if row[1] <= through]), through)
    return EventPage(stored_events(rows))


class EventTables:
    """The events and scalars of ``SqliteStore``; its ``__init__`` sets the attributes named here."""

    db: SqliteDatabase
    #: Windows read whole, by (run, step_min, step_max): the newest rowid read and the window's events.
    _windows: OrderedDict[tuple[int, int, int], tuple[int, list[StoredEvent]]]
    _windows_lock: threading.Lock

    def put_events(self, events: list[RankEvent]) -> list[PutOutcome]:
        """One write transaction for the batch, the new events inserted with one ``executemany`` (a
        duplicate never writes)."""
        return self._put("events", events)

    def put_scalars(self, events: list[ScalarEvent]) -> list[PutOutcome]:
        return self._put("scalars", events)

    def _put(self, table: str, events: Sequence[Event]) -> list[PutOutcome]:
        if not events:
            return []
        insert = (
            f"INSERT INTO {table} (run, step, event_id, rank, world_size, local_rank, keys, v, h)"  # noqa: S608 - a constant
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        with self.db.write_runs(f"storing {table}", {(e.project, e.run_id) for e in events}) as (conn, runs):
            rows = []
            for event in events:
                packed = struct.pack(f"<{2 + len(event.values)}d", event.weight, event.time, *event.values)
                keys = "\n".join(event.keys)
                fields = (event.step, event.event_id, event.rank, event.world_size, event.local_rank, keys)
                rows.append((runs[(event.project, event.run_id)], *fields, packed, event.payload_digest))
            # Nearly every batch is new: it is inserted as it is, and only when an id is already
            # stored (a retry, a reused id) does the unique index refuse it; then the savepoint is
            # undone and each event is told apart by the digests stored (an index probe per event,
            # which a new batch never pays).
            conn.execute("SAVEPOINT new_events")
            try:
                conn.executemany(insert, rows)
                return ["stored"] * len(events)
            except sqlite3.IntegrityError:
                conn.execute("ROLLBACK TO new_events")
            finally:
                conn.execute("RELEASE new_events")
            stored = self._stored_digests(conn, table, runs, events)
            outcomes: list[PutOutcome] = []
            new = []
            for event, row in zip(events, rows, strict=True):
                key = (row[0], event.step, event.event_id)
                digest = stored.get(key)
                if digest is None:
                    stored[key] = event.payload_digest
                    outcomes.append("stored")
                    new.append(row)
                elif digest == event.payload_digest:
                    outcomes.append("duplicate")
                else:
                    outcomes.append(
                        EventIdReused(f"event {event.event_id!r} is already stored with a different payload")
                    )
            conn.executemany(insert, new)
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
        high = MAX_SQL_INT if step_max is None else step_max
        with self.db.read_run("reading events", project, run_id) as (conn, run):
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
                        events = events + stored_events(rows)
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

    def read_event_rows(self, wanted: RowsWanted) -> EventRows:
        """One query from ``after`` on (the index seeks to its step), ``max_items + 1`` rows at most."""
        return self._rows("events", wanted)

    def read_scalar_rows(self, wanted: RowsWanted) -> EventRows:
        """As ``read_event_rows``, for scalar events."""
        return self._rows("scalars", wanted)

    def _rows(self, table: str, wanted: RowsWanted) -> EventRows:
        project, run_id, step_min, step_max, after, ranks, max_items = wanted
        position = after or (step_min, -1, "")
        low = max(step_min, position[0] + (position[1] >= MAX_WORLD_SIZE))
        high = MAX_SQL_INT if step_max is None else step_max
        # The ranks are ints (a frozenset of them, checked by the caller's type), written inline: a
        # bound parameter each would meet SQLite's limit at large worlds.
        chosen = "" if ranks is None else f" AND rank IN ({','.join(str(int(r)) for r in sorted(ranks))})"
        sql = _SELECT_ROWS.format(table=table, ranks=chosen)
        with self.db.read_run(f"reading {table}", project, run_id) as (conn, run):
            if run is None or low > high or (ranks is not None and not ranks):
                return event_rows([], None)
            rows = conn.execute(sql, (run, low, high, *position, max_items + 1)).fetchall()
        if len(rows) > max_items:
            del rows[max_items:]
            last = rows[-1]
            return event_rows(rows, (last[1], last[2], last[0]))
        return event_rows(rows, None)

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
        with self.db.read_run("reading events", project, run_id) as (conn, run):
            if run is None:
                return None
            row = conn.execute(
                "SELECT min(step) FROM events WHERE run = ? AND step BETWEEN ? AND ?",
                (run, step_min, MAX_SQL_INT if step_max is None else step_max),
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
        high = MAX_SQL_INT if step_max is None else step_max
        with self.db.read_run("reading scalars", project, run_id) as (conn, run):
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
