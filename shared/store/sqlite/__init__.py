"""The store port on SQLite: one database file in WAL mode, for ``instantml local``.

``SqliteStore`` is assembled from one class per port, each in the module named for it, over one
``shared.store.sqlite.database.SqliteDatabase``:

- ``shared.store.sqlite.events``: rank events and ``run.log`` scalars (``EventStore``, ``ScalarStore``);
- ``shared.store.sqlite.runs``: run records (``RunStore``);
- ``shared.store.sqlite.rollups``: rollups (``RollupStore``);
- ``shared.store.sqlite.alerts``: webhooks (``AlertStore``) and the outbox of alerts to send;
- ``shared.store.sqlite.watch``: the watch's reads and writes (``WatchStore``);
- ``shared.store.sqlite.feed``: the change feed the local stack's rollup worker reads.

``shared.store.sqlite.tokens`` holds API tokens in the same database, ``shared.store.sqlite.schema``
its tables (and what each holds) and migrations, ``shared.store.sqlite.codecs`` the rows as the port's
values, ``shared.store.sqlite.database`` the file, its connections and the check of a damaged file.

Durability: WAL with ``synchronous=NORMAL`` keeps every committed transaction through a killed
process (SIGKILL included); a batch is committed before it is answered. Writers queue on SQLite's lock
for up to ``shared.store.sqlite.database.BUSY_TIMEOUT_S``, then the request is answered 429 with
``Retry-After``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from shared.store.sqlite.alerts import Alerts
from shared.store.sqlite.database import SqliteDatabase, check_database
from shared.store.sqlite.events import EventTables
from shared.store.sqlite.feed import ChangeFeed
from shared.store.sqlite.rollups import Rollups
from shared.store.sqlite.runs import RunRecords
from shared.store.sqlite.tokens import SqliteTokenStore
from shared.store.sqlite.watch import Watch

__all__ = ["SqliteStore", "SqliteTokenStore", "check_database"]


class SqliteStore(EventTables, RunRecords, Rollups, Alerts, Watch, ChangeFeed):
    """Events, rollups and the change feed in one SQLite database (see the package's docstring)."""

    #: Every note's time is recorded as it comes: a run's row costs microseconds to rewrite (``RunStore``).
    run_time_resolution_s = 0.0

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        """``clock`` is the server's: when a run's events are received (tests and replays set it)."""
        self.db = SqliteDatabase(path)
        self.clock = clock
        self._windows = OrderedDict()
        self._windows_lock = threading.Lock()
