"""One SQLite database file: a connection per thread in WAL mode, its failures as the port's errors,
write transactions, the numbers of runs (the tables key events by an integer per run), and whether the
file is damaged, checked before the local stack opens it (``check_database``, for ``infra.local.stack``)."""

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
