"""What only the DynamoDB adapter does: its documented quirk (shared/store/dynamodb.py's docstring).

An event id is unique per (run, shard, step), not per run: the same id sent again with another step,
or with a rank in another shard, is a different item and is stored as a second event rather than
refused. A genuine retry resends the same body, so it always lands on the same item."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.models import EventIdReused, RankEvent, to_rank_event, validate_body
from shared.query import SummaryQuery
from shared.store.dynamodb import SHARDS, DynamoStore
from shared.summary import distributed_summary

PROJECT = "proj"
RUN = "run-a"


@pytest.fixture
def store(metrics_table: str, atomic_moto_puts: None) -> Iterator[DynamoStore]:
    yield DynamoStore(metrics_table)


def _event(step: int, rank: int, value: float, event_id: str = "the-id") -> RankEvent:
    body = {"step": step, "rank": rank, "world_size": 32, "metrics": {"train/loss": value}, "time": 1.0}
    return to_rank_event(PROJECT, RUN, validate_body(body), event_id, 0.0)


def _events(store: DynamoStore) -> list[tuple[str, int, int]]:
    return sorted((e.event_id, e.step, e.rank) for e in store.read_events(PROJECT, RUN).events)


def test_given_a_stored_id_when_it_is_reused_at_another_step_then_it_is_stored_as_a_second_event(
    store: DynamoStore,
) -> None:
    assert store.put_events([_event(3, 0, 1.0)]) == ["stored"]

    assert store.put_events([_event(4, 0, 2.0)]) == ["stored"]

    assert _events(store) == [("the-id", 3, 0), ("the-id", 4, 0)]
    # Each counts like any other event at its own (step, rank).
    doc = distributed_summary(store, PROJECT, RUN, SummaryQuery())
    assert doc is not None and doc["steps"] == [3, 4]
    assert doc["heatmap"]["train/loss"]["values"][0] == [1.0, 2.0]
    # Each item is still idempotent on its own.
    assert store.put_events([_event(3, 0, 1.0), _event(4, 0, 2.0)]) == ["duplicate", "duplicate"]


def test_given_a_reused_id_at_the_same_step_then_only_a_rank_in_another_shard_makes_a_second_event(
    store: DynamoStore,
) -> None:
    assert store.put_events([_event(3, 1, 1.0)]) == ["stored"]

    # Rank 1 + 16 shares rank 1's shard: the same item, another payload, refused.
    [same_shard] = store.put_events([_event(3, 1 + SHARDS, 5.0)])
    assert isinstance(same_shard, EventIdReused)
    # Rank 2 lives in another shard: another item, stored.
    assert store.put_events([_event(3, 2, 7.0)]) == ["stored"]

    assert _events(store) == [("the-id", 3, 1), ("the-id", 3, 2)]
