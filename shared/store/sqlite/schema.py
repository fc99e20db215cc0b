"""The database's tables, made when missing, and the migrations of databases made by earlier versions.

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
- ``feed_cursors``: how far a reader of the change feed (``shared.store.sqlite.feed``) has got, kept
  across restarts.
- ``tokens``: API tokens by SHA-256 (``shared.tokens``).
- ``processes``: one row per (run, rank), overwritten: the document of the rank's process
  (``shared.processes.records``: who it is, its liveness, how it ended; contract 8), a JSON object.
- ``alert_hooks``, ``webhook_deliveries`` and ``outbox``: a project's webhooks, how the last POST to
  each went, and the alerts waiting to be sent (``shared.store.sqlite.alerts``).
"""

from __future__ import annotations

import sqlite3

from shared.store.sqlite.codecs import event_time, rank_bitmap

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
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    project TEXT NOT NULL, url TEXT NOT NULL, state TEXT NOT NULL, reason TEXT, at REAL NOT NULL,
    PRIMARY KEY (project, url));
CREATE TABLE IF NOT EXISTS outbox (
    id TEXT PRIMARY KEY, project TEXT NOT NULL, url TEXT NOT NULL, payload TEXT NOT NULL,
    created REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL,
    last_error TEXT, dead INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (dead, next_at);
CREATE TABLE IF NOT EXISTS processes (
    run INTEGER NOT NULL, rank INTEGER NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (run, rank));
"""

#: Events stored last that a database made before run records is searched for its runs' latest time.
_LATEST_ROWS = 1000
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
    "watch": "TEXT",  # the watch's state (shared.watch.rounds.WatchState as JSON)
    "headline": "TEXT",  # the worst finding in a few words ("rank 5 stopped")
    "hosts": "TEXT",  # a JSON object: rank -> host
}


def create_schema(conn: sqlite3.Connection) -> None:
    """The tables and indexes, made when missing, on a database migrated first when it is an old one."""
    _drop_single_level_rollups(conn)
    conn.executescript(SCHEMA)
    _add_run_columns(conn)
    conn.execute("CREATE INDEX IF NOT EXISTS runs_by_received ON runs (received)")


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
            _fill_run_record(conn, run)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute(
        "CREATE INDEX IF NOT EXISTS runs_by_activity ON runs (project, last_event DESC, run_id DESC)"
    )


def _fill_run_record(conn: sqlite3.Connection, run: int) -> None:
    """One run's record from its stored events (inside ``_add_run_columns``' transaction)."""
    (last_step,) = conn.execute("SELECT max(step) FROM events WHERE run = ?", (run,)).fetchone()
    if last_step is None:
        return
    rows = conn.execute(
        "SELECT rank, world_size, v FROM events WHERE run = ? AND step = ?", (run, last_step)
    ).fetchall()
    first = conn.execute("SELECT v FROM events WHERE run = ? ORDER BY step LIMIT 1", (run,)).fetchone()
    # The latest time is at the last step, or among the events stored last (a late rank's).
    latest = conn.execute(
        "SELECT v FROM events WHERE run = ? ORDER BY rowid DESC LIMIT ?", (run, _LATEST_ROWS)
    ).fetchall()
    packed = [v for _, _, v in rows] + [v for (v,) in latest]
    last_event = max(event_time(v) for v in packed)
    bits = sum(1 << rank for rank, _, _ in rows)
    conn.execute(
        "UPDATE runs SET created = ?, last_event = ?, last_step = ?, ranks = ?, world_size = ? WHERE id = ?",
        (
            min(event_time(first[0]), last_event),
            last_event,
            last_step,
            rank_bitmap(bits),
            max(size for _, size, _ in rows),
            run,
        ),
    )
