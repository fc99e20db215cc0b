"""Per-project API tokens (contract 3.1): made, stored as hashes, looked up, revoked.

A token is ``iml_<token_id>_<secret>``: 256 bits of secret from ``secrets``, shown once at creation.
The tokens table keeps only its SHA-256 (``token_hash``, the partition key), the project it grants,
and the public ``token_id`` used to list and revoke it. A record whose project is ``*`` grants every
project: only the local stack makes one, for the single token it prints.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Protocol

HASH_KEY = "token_hash"
ANY_PROJECT = "*"


def token_hash(token: str) -> str:
    # "surrogatepass": a header holding a lone surrogate hashes to some unknown token (a 401), not a 500.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def same_text(a: str, b: str) -> bool:
    """``a == b`` in constant time. ``hmac.compare_digest`` raises ``TypeError`` on ``str`` that is not
    ASCII (a project name in a path can be anything), so it compares their bytes."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def new_token() -> tuple[str, str]:
    """A fresh token and its public id."""
    token_id = secrets.token_hex(4)
    return f"iml_{token_id}_{secrets.token_urlsafe(32)}", token_id


@dataclass(frozen=True)
class TokenRecord:
    token_id: str
    project: str
    created: float
    revoked: bool = False
    description: str = ""

    def grants(self, project: str) -> bool:
        return not self.revoked and (self.project == ANY_PROJECT or same_text(self.project, project))


class TokenStore(Protocol):
    """Where tokens are kept (``shared.store``): the authorizer only looks up; operators create, list
    and revoke."""

    def lookup_hash(self, digest: str) -> TokenRecord | None:
        """The record of the token whose ``token_hash`` is ``digest``; None when there is none. The store
        is given the hash, never the token."""
        ...

    def create(
        self, project: str, description: str = "", token: str | None = None
    ) -> tuple[str, TokenRecord]: ...

    def list(self, project: str | None = None) -> list[TokenRecord]: ...

    def revoke(self, token_id: str) -> bool: ...


#: How long a warm authorizer keeps a verdict when its store does not say (``cache_ttl_s``).
DEFAULT_TTL_S = 60.0


class TokenCache:
    """Token hash -> record for ``ttl`` seconds, in a warm authorizer: one table read per token per TTL.

    A revoked token therefore stops working within ``ttl`` seconds. The TTL is the store's
    ``cache_ttl_s`` when it has one, else ``DEFAULT_TTL_S``: on AWS, DynamoDB reads cost a few ms and
    money, so verdicts are kept 60 s (revocation within a minute); the local stack's SQLite store reads
    a token in microseconds and sets 0, so every request is checked and revocation is immediate.
    """

    def __init__(self, store: TokenStore, ttl: float | None = None, max_entries: int = 10_000) -> None:
        if ttl is None:
            ttl = float(getattr(store, "cache_ttl_s", DEFAULT_TTL_S))
        self.store, self.ttl, self.max_entries = store, ttl, max_entries
        self._entries: dict[str, tuple[float, TokenRecord | None]] = {}

    def lookup(self, token: str, now: float | None = None) -> TokenRecord | None:
        digest = token_hash(token)
        if self.ttl <= 0:
            return self.store.lookup_hash(digest)
        now = time.monotonic() if now is None else now
        cached = self._entries.get(digest)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        record = self.store.lookup_hash(digest)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = (now, record)
        return record
