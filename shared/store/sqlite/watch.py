"""The watch's side of the store (``WatchStore``, for ``shared.watch.rounds``): the runs received lately, and
each round's result saved with the alerts it decided in one transaction."""

from __future__ import annotations

from shared.store.port import Delivery, RunRecord
from shared.store.sqlite.codecs import outbox_row, run_record
from shared.store.sqlite.database import SqliteDatabase
from shared.store.sqlite.runs import SELECT_RUN


class Watch:
    """The watch's reads and writes of ``SqliteStore``; its ``__init__`` sets ``db``."""

    db: SqliteDatabase

    def watched_runs(self, received_after: float, limit: int) -> list[tuple[str, RunRecord]]:
        with self.db.errors("listing the runs to watch"):
            rows = self.db.connection().execute(
                "SELECT project, "
                + SELECT_RUN.removeprefix("SELECT ")
                + " WHERE received >= ? AND last_event IS NOT NULL ORDER BY received DESC LIMIT ?",
                (received_after, limit),
            )
            return [(row[0], run_record(row[1:])) for row in rows]

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
                [outbox_row(d, at) for d in deliveries],
            )
