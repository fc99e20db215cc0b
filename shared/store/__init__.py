"""Storage behind one port (``shared.store.port``), opened by URL; adapters are imported lazily.

- ``sqlite:///path/to/instantml.db``: the local stack's database (standard library only);
- ``dynamodb://TABLE``: a DynamoDB table (boto3; the endpoint and credentials from the environment).

Functions find their store in ``INSTANTML_STORE_URL`` when it names a SQLite database (the local
stack sets it); otherwise in the tables the template names (``METRICS_TABLE``, ``TOKENS_TABLE``), as
deployed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.store.port import MetricsStore
    from shared.tokens import TokenStore

STORE_URL_ENV = "INSTANTML_STORE_URL"


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite://{os.path.abspath(path)}"


def _url(url: str | None, table_variable: str) -> tuple[str, str]:
    if url is None:
        url = os.environ.get(STORE_URL_ENV, "")
        if not url.startswith("sqlite://"):
            url = f"dynamodb://{os.environ[table_variable]}"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("sqlite", "dynamodb") or not rest:
        raise ValueError(f"a store URL is sqlite:///PATH or dynamodb://TABLE, got {url!r}")
    return scheme, rest


def open_store(url: str | None = None) -> MetricsStore:
    """The events and rollups store at ``url`` (default: from the environment, see above)."""
    scheme, rest = _url(url, "METRICS_TABLE")
    if scheme == "sqlite":
        from shared.store.sqlite import SqliteStore

        return SqliteStore(rest)
    from shared.store.dynamodb import DynamoStore

    return DynamoStore(rest)


def open_token_store(url: str | None = None) -> TokenStore:
    """The tokens store at ``url`` (default: from the environment; the tokens table on DynamoDB)."""
    scheme, rest = _url(url, "TOKENS_TABLE")
    if scheme == "sqlite":
        from shared.store.sqlite import SqliteTokenStore

        return SqliteTokenStore(rest)
    from shared.store.dynamodb import DynamoTokenStore

    return DynamoTokenStore(rest)
