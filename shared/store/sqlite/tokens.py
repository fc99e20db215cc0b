"""API tokens (``shared.tokens``) in the ``tokens`` table of the same database."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from shared.store.sqlite import database
from shared.store.sqlite.database import SqliteDatabase
from shared.tokens import TokenRecord, new_token, token_hash


class SqliteTokenStore:
    """API tokens (``shared.tokens``) in the same database."""

    #: The authorizer's cache TTL (``shared.tokens.TokenCache``): none. A lookup is one primary-key read
    #: of a local file (about 10 us) on one connection kept for lookups (an HTTP connection is a thread
    #: of its own; a connection per thread would be opened per request), so each request sees the table
    #: as committed: `instantml tokens revoke` takes effect at the next request.
    cache_ttl_s = 0.0

    def __init__(self, path: str | Path) -> None:
        self.db = SqliteDatabase(path)
        self._lookups: sqlite3.Connection | None = None
        self._lookups_lock = threading.Lock()

    def lookup_hash(self, digest: str) -> TokenRecord | None:
        try:
            with self._lookups_lock:
                if self._lookups is None:
                    self._lookups = sqlite3.connect(
                        self.db.path,
                        timeout=database.BUSY_TIMEOUT_S,
                        isolation_level=None,
                        check_same_thread=False,
                    )
                row = self._lookups.execute(
                    "SELECT token_id, project, created, revoked, description FROM tokens"
                    " WHERE token_hash = ?",
                    (digest,),
                ).fetchone()
        except sqlite3.DatabaseError:
            # Told as the port's errors only when it fails: every request of the stack makes a lookup.
            with self.db.errors("reading tokens"):
                raise
        return None if row is None else token_record(row)

    def create(
        self, project: str, description: str = "", token: str | None = None
    ) -> tuple[str, TokenRecord]:
        if token is None:
            token, token_id = new_token()
        else:
            token_id = token_hash(token)[:8]
        digest = token_hash(token)
        record = TokenRecord(token_id, project, time.time(), False, description)
        with self.db.write("storing a token") as conn:
            conn.execute(
                "INSERT INTO tokens (token_hash, token_id, project, created, description)"
                " VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                (digest, token_id, project, record.created, description),
            )
        found = self.lookup_hash(digest)
        assert found is not None
        return token, found

    def list(self, project: str | None = None) -> list[TokenRecord]:
        with self.db.errors("reading tokens"):
            rows = self.db.connection().execute(
                "SELECT token_id, project, created, revoked, description FROM tokens ORDER BY created"
            )
            records = [token_record(r) for r in rows]
        return [r for r in records if project in (None, r.project)]

    def revoke(self, token_id: str) -> bool:
        with self.db.write("revoking a token") as conn:
            changed = conn.execute("UPDATE tokens SET revoked = 1 WHERE token_id = ?", (token_id,)).rowcount
        return changed > 0


def token_record(row: tuple[Any, ...]) -> TokenRecord:
    """A row of ``token_id, project, created, revoked, description``."""
    return TokenRecord(row[0], row[1], row[2], bool(row[3]), row[4])
