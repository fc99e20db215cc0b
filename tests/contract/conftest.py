"""The store port's contract suite runs over both adapters: SQLite in a temporary directory and
DynamoDB in moto with the template's table. A test takes the ``store`` fixture and runs once per
adapter."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def atomic_moto_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make moto's conditional ``PutItem`` atomic, as DynamoDB's is.

    moto reads the current item, evaluates the condition and then writes, with no lock between: two
    threads putting the same new item at once can both pass ``attribute_not_exists`` and both be
    answered as written, which DynamoDB never does (writes to one item are serialized). Without this,
    a concurrency test on moto would test moto's race, not the adapter.
    """
    from moto.dynamodb.models.table import Table

    lock = threading.Lock()
    put_item = Table.put_item

    def atomic_put_item(self: Table, *args: Any, **kwargs: Any) -> Any:
        with lock:
            return put_item(self, *args, **kwargs)

    monkeypatch.setattr(Table, "put_item", atomic_put_item)


# moto's round trips make the DynamoDB half of the suite most of its time: `make quick` runs SQLite.
@pytest.fixture(params=["sqlite", pytest.param("dynamodb", marks=pytest.mark.slow)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        from shared.store.sqlite import SqliteStore

        yield SqliteStore(tmp_path / "instantml.db")
        return
    table = request.getfixturevalue("metrics_table")
    request.getfixturevalue("atomic_moto_puts")
    from shared.store.dynamodb import DynamoStore

    # The alerts table and queue the template names (``metrics_table`` made them and set the functions'
    # environment to them).
    yield DynamoStore(
        table, alerts_table=os.environ["ALERTS_TABLE"], alerts_queue=os.environ["ALERTS_QUEUE_URL"]
    )
