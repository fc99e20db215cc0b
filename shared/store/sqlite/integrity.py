"""Whether a database file is damaged, checked before the local stack opens it (``infra.local.stack``)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

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
