"""Storage behind one port (``shared.store.port``), opened by URL; adapters are imported lazily.

- ``sqlite:///path/to/instantml.db``: the local stack's database (standard library only);
- ``dynamodb://TABLE?runs=RUNS_TABLE&alerts=ALERTS_TABLE&queue=QUEUE_URL``: the metrics table, the runs
  table, the alerts table and the alerts queue (boto3; the endpoint and credentials from the environment).

The functions choose the URL at their edge (``functions/api.py``, the authorizer): the database named
by ``INSTANTML_STORE_URL`` when the local stack sets it, else the tables the template names, as
deployed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

if TYPE_CHECKING:
    from shared.store.port import MetricsStore
    from shared.tokens import TokenStore

#: Set by ``instantml local`` to its database; unset on AWS.
STORE_URL_ENV = "INSTANTML_STORE_URL"
#: The local database's change-feed reader that rolls the events up (``infra.local.triggers``): the
#: events after its position are not in the rollups yet.
ROLLUP_FEED = "rollups"
#: Where the API is served (links in alerts): the template sets it on AWS, ``instantml local`` to its URL.
PUBLIC_URL_ENV = "PUBLIC_URL"


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite://{os.path.abspath(path)}"


def _parse(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("sqlite", "dynamodb") or not rest:
        raise ValueError(f"a store URL is sqlite:///PATH or dynamodb://TABLE?runs=TABLE, got {url!r}")
    return scheme, rest


def open_store(url: str) -> MetricsStore:
    """The events and rollups store at ``url``."""
    scheme, rest = _parse(url)
    if scheme == "sqlite":
        from shared.store.sqlite import SqliteStore

        return SqliteStore(rest)
    from shared.store.dynamodb import DynamoStore

    table, _, query = rest.partition("?")
    names = dict(parse_qsl(query))
    return DynamoStore(
        table,
        runs_table=names.get("runs") or None,
        alerts_table=names.get("alerts") or None,
        alerts_queue=names.get("queue") or None,
    )


def open_token_store(url: str) -> TokenStore:
    """The tokens store at ``url`` (with SQLite, the same database as the events)."""
    scheme, rest = _parse(url)
    if scheme == "sqlite":
        from shared.store.sqlite import SqliteTokenStore

        return SqliteTokenStore(rest)
    from shared.store.dynamodb import DynamoTokenStore

    return DynamoTokenStore(rest)
