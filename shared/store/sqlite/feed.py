"""The change feed (what the stream is to DynamoDB): the events table in ``rowid`` order, and how far
each named reader (the local stack's rollup worker, ``infra.local.triggers``) has got, kept across
restarts in ``feed_cursors``. A duplicate inserts nothing, so it is no change."""

from __future__ import annotations

from shared.store.sqlite.database import SqliteDatabase

#: A change of the feed: (project, run_id, step) where new events were stored.
Change = tuple[str, str, int]


class ChangeFeed:
    """The change feed of ``SqliteStore``; its ``__init__`` sets ``db``."""

    db: SqliteDatabase

    def read_changes(self, after: int, limit: int) -> tuple[list[Change], int]:
        """The steps that the next ``limit`` events stored after position ``after`` touched, each once,
        in the order of its first event; and the new position. A reader rolls up steps, not events:
        SQLite groups the thousand events of a step into one row (Python took a third of the rollup
        worker's time doing it)."""
        with self.db.errors("reading changes"):
            rows = (
                self.db.connection()
                .execute(
                    "SELECT r.project, r.run_id, c.step, max(c.rowid) FROM"
                    " (SELECT rowid, run, step FROM events WHERE rowid > ? ORDER BY rowid LIMIT ?) AS c"
                    " JOIN runs r ON r.id = c.run GROUP BY c.run, c.step ORDER BY min(c.rowid)",
                    (after, limit),
                )
                .fetchall()
            )
        position = max((last for *_, last in rows), default=after)
        return [(project, run_id, step) for project, run_id, step, _ in rows], position

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
