"""Run records (``RunStore``): the ``runs`` table's columns past a run's number, updated as events and
updates arrive, and listed newest first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.store.port import RunActivity, RunRecord, RunStatus
from shared.store.sqlite.codecs import merged_hosts, noted_activity, run_record
from shared.store.sqlite.database import SqliteDatabase

#: A run record's columns in the order ``shared.store.sqlite.codecs.run_record`` reads them.
SELECT_RUN = (
    "SELECT run_id, created, last_event, last_step, world_size, ranks, finished, config, findings,"
    " findings_at, received, watch, headline, hosts FROM runs"
)
_STATUS_SQL = {
    "finished": "finished IS NOT NULL",
    "live": "(finished IS NULL AND last_event >= ?)",
    "idle": "(finished IS NULL AND last_event < ?)",
}


class RunRecords:
    """The run records of ``SqliteStore``; its ``__init__`` sets the attributes named here."""

    db: SqliteDatabase
    #: The server's clock: when a run's events are received.
    clock: Callable[[], float]

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        with self.db.write_runs("recording the run's activity", [(project, run_id)]) as (conn, keys):
            run = keys[(project, run_id)]
            row = conn.execute(
                "SELECT created, last_event, last_step, ranks, world_size FROM runs WHERE id = ?", (run,)
            ).fetchone()
            conn.execute(
                "UPDATE runs SET created = ?, last_event = ?, last_step = ?, ranks = ?, world_size = ?,"
                " received = max(coalesce(received, 0), ?) WHERE id = ?",
                (*noted_activity(row, activity), self.clock(), run),
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
        with self.db.write_runs("updating the run", [(project, run_id)]) as (conn, keys):
            run = keys[(project, run_id)]
            if hosts:  # merged with the ranks' hosts already kept (in the write's transaction)
                (kept,) = conn.execute("SELECT hosts FROM runs WHERE id = ?", (run,)).fetchone()
                conn.execute("UPDATE runs SET hosts = ? WHERE id = ?", (merged_hosts(kept, hosts), run))
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
                    SELECT_RUN + " WHERE project = ? AND run_id = ? AND last_event IS NOT NULL",
                    (project, run_id),
                )
                .fetchone()
            )
        return None if row is None else run_record(row)

    def update_process(
        self, project: str, run_id: str, rank: int, change: Callable[[str | None], str | None]
    ) -> None:
        with self.db.write_runs("recording the process", [(project, run_id)]) as (conn, keys):
            run = keys[(project, run_id)]
            row = conn.execute("SELECT doc FROM processes WHERE run = ? AND rank = ?", (run, rank)).fetchone()
            doc = change(None if row is None else row[0])
            if doc is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO processes (run, rank, doc) VALUES (?, ?, ?)", (run, rank, doc)
                )

    def processes(self, project: str, run_id: str) -> dict[int, str]:
        with self.db.errors("reading the run's processes"):
            rows = self.db.connection().execute(
                "SELECT rank, doc FROM processes JOIN runs ON runs.id = processes.run"
                " WHERE runs.project = ? AND runs.run_id = ?",
                (project, run_id),
            )
            return dict(rows)

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
        sql = SELECT_RUN + " WHERE " + " AND ".join(where)  # only constants are joined in
        with self.db.errors("listing runs"):
            rows = self.db.connection().execute(
                sql + " ORDER BY last_event DESC, run_id DESC LIMIT ?", (*params, limit)
            )
            return [run_record(row) for row in rows]
