"""One SQLite database file: a connection per thread in WAL mode, its failures as the port's errors,
write transactions, and the numbers of runs (the tables key events by an integer per run)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import StoreThrottled, StoreUnavailable
from shared.store.sqlite.schema import create_schema

#: How long a writer queues on SQLite's lock before the request is answered 429 with ``Retry-After``.
BUSY_TIMEOUT_S = 10.0
#: The largest integer SQLite stores: an open-ended window's last step.
MAX_SQL_INT = 2**63 - 1
#: SQLITE_CORRUPT and SQLITE_NOTADB: the file is damaged, and no retry mends it.
_DAMAGED = (11, 26)


class SqliteDatabase:
    """One database file, one connection per thread (SQLite connections are not shared)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._runs: dict[tuple[str, str], int] = {}
        with self.errors("opening the database"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            create_schema(self.connection())

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

    @contextmanager
    def read_run(
        self, doing: str, project: str, run_id: str
    ) -> Iterator[tuple[sqlite3.Connection, int | None]]:
        """This thread's connection and the run's number (None: no such run), its failures as the port's."""
        with self.errors(doing):
            conn = self.connection()
            yield conn, self.run_key(conn, project, run_id, create=False)

    @contextmanager
    def write_runs(
        self, doing: str, runs: Iterable[tuple[str, str]]
    ) -> Iterator[tuple[sqlite3.Connection, dict[tuple[str, str], int]]]:
        """``write``, with the numbers of the ``(project, run_id)`` runs it writes (made when new)."""
        with self.write(doing) as conn:
            yield conn, {run: self.new_run_key(conn, *run) for run in runs}

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
