"""The store port's contract suite runs over both adapters: SQLite in a temporary directory and
DynamoDB in moto with the template's table. A test takes the ``store`` fixture and runs once per
adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(params=["sqlite", "dynamodb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        from shared.store.sqlite import SqliteStore

        yield SqliteStore(tmp_path / "instantml.db")
        return
    table = request.getfixturevalue("metrics_table")
    from shared.store.dynamodb import DynamoStore

    yield DynamoStore(table)
