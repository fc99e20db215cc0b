"""Rollups (``RollupStore``, levels of ``shared.rollups``): the ``rollup_headers``, ``rollup_values``
and ``rollup_marks`` tables, and the events the rollup worker has not read yet."""

from __future__ import annotations

from shared.rollups import BlockHeader, RolledBlock, unpack_header
from shared.store import ROLLUP_FEED
from shared.store.port import RollupProgress
from shared.store.sqlite.database import MAX_SQL_INT, SqliteDatabase


class Rollups:
    """The rollups of ``SqliteStore``; its ``__init__`` sets ``db``."""

    db: SqliteDatabase

    def read_blocks(self, project: str, run_id: str, size: int, first: int, last: int) -> list[BlockHeader]:
        with self.db.read_run("reading rollups", project, run_id) as (conn, run):
            if run is None:
                return []
            rows = conn.execute(
                "SELECT block, h, keys FROM rollup_headers"
                " WHERE run = ? AND size = ? AND block BETWEEN ? AND ? ORDER BY block",
                (run, size, first, min(last, MAX_SQL_INT)),
            ).fetchall()
        return [unpack_header(size, block, h, keys.split("\n")) for block, h, keys in rows]

    def read_block_sums(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        sums: dict[str, dict[int, bytes]] = {key: {} for key in keys}
        with self.db.read_run("reading rollups", project, run_id) as (conn, run):
            if run is None:
                return sums
            for key in keys:
                rows = conn.execute(
                    "SELECT block, v FROM rollup_values"
                    " WHERE run = ? AND key = ? AND size = ? AND block BETWEEN ? AND ?",
                    (run, key, size, first, min(last, MAX_SQL_INT)),
                )
                sums[key] = dict(rows)
        return sums

    def write_blocks(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        with self.db.write_runs("writing rollups", [(project, run_id)]) as (conn, keys):
            run = keys[(project, run_id)]
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
        with self.db.read_run("reading rollups", project, run_id) as (conn, run):
            if run is None:
                return RollupProgress()
            row = conn.execute("SELECT step, nodes FROM rollup_marks WHERE run = ?", (run,)).fetchone()
        return RollupProgress() if row is None else RollupProgress(int(row[0]), bytes(row[1]))

    def late_steps(self, project: str, run_id: str, step_min: int, step_max: int, limit: int) -> list[int]:
        """The events the rollup worker has not read yet (after its feed position: its backlog, seconds of
        ingest at most) at steps it has rolled up already. None where no worker reads the feed (the
        rollups are then made by whoever calls ``roll_up``, from every event there is)."""
        with self.db.read_run("reading events", project, run_id) as (conn, run):
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
        with self.db.write_runs("writing rollups", [(project, run_id)]) as (conn, keys):
            run = keys[(project, run_id)]
            conn.execute(
                "INSERT INTO rollup_marks (run, step, nodes) VALUES (?, ?, ?)"
                " ON CONFLICT DO UPDATE SET step = max(step, excluded.step), nodes = excluded.nodes",
                (run, step, nodes),
            )
