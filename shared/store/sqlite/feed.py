"""The change feed (what the stream is to DynamoDB): the events table in ``rowid`` order, and how far
each named reader (the local stack's rollup worker, ``infra.local.triggers``) has got, kept across
restarts in ``feed_cursors``. A duplicate inserts nothing, so it is no change."""

from __future__ import annotations

from shared.store.sqlite.database import SqliteDatabase

#: A change of the feed: (project, run_id, step) of a newly stored event.
Change = tuple[str, str, int]


class ChangeFeed:
    """The change feed of ``SqliteStore``; its ``__init__`` sets ``db``."""

    db: SqliteDatabase

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
