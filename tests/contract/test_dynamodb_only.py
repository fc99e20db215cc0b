"""What only the DynamoDB adapter does: its documented quirk (shared/store/dynamodb.py's docstring).

An event id is unique per (run, shard, step), not per run: the same id sent again with another step,
or with a rank in another shard, is a different item and is stored as a second event rather than
refused. A genuine retry resends the same body, so it always lands on the same item."""

from __future__ import annotations

import dataclasses
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
    assert doc is not None
    assert doc["steps"] == [3, 4]
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


def test_with_a_retention_what_ingest_writes_expires_and_without_one_nothing_does(metrics_table: str) -> None:
    """template.yaml's RetentionDays: events, scalars and the run's items carry ``expires`` (the tables'
    TTL attribute) that long after they were written; 0 (the default) writes none."""
    import boto3

    from shared.store.dynamodb import EXPIRES, RUNS_INDEX, scalar_partition
    from shared.store.port import RunActivity

    now = 1_800_000_000.0
    keeping = DynamoStore(metrics_table, runs_table="test-runs", retention_days=30, clock=lambda: now)
    keeping.put_events([_event(1, 3, 0.5, "kept-30-days")])
    keeping.put_scalars([dataclasses.replace(_event(1, 0, 0.5, "a-scalar"), world_size=0)])
    keeping.note_activity(PROJECT, RUN, RunActivity(now, 1, frozenset({3}), 32))
    keeping.update_run(PROJECT, RUN, now, config='{"lr": 1}')
    client = boto3.client("dynamodb")
    events = client.scan(TableName=metrics_table)["Items"]
    assert {i["pk"]["S"] for i in events} == {f"{PROJECT}#{RUN}#03", scalar_partition(PROJECT, RUN)}
    runs = client.scan(TableName="test-runs")["Items"]
    assert len(events) == 2
    assert len(runs) == 3  # an event, a scalar; the run, its config, its rank group
    for item in events + runs:
        assert item[EXPIRES] == {"N": str(int(now + 30 * 86400))}, item
    index = client.query(
        TableName="test-runs",
        IndexName=RUNS_INDEX,
        KeyConditionExpression="#p = :p",
        ExpressionAttributeNames={"#p": "project"},
        ExpressionAttributeValues={":p": {"S": PROJECT}},
    )["Items"]
    assert len(index) == 1
    assert EXPIRES not in index[0]  # the index holds no more than before

    keeping_nothing = DynamoStore(metrics_table, runs_table="test-runs", retention_days=0)
    keeping_nothing.put_events([_event(2, 3, 0.5, "kept-for-ever")])
    keeping_nothing.note_activity(PROJECT, "run-b", RunActivity(now, 2, frozenset({3}), 32))
    later = [i for i in client.scan(TableName=metrics_table)["Items"] if "kept-for-ever" in i["sk"]["S"]]
    later += [i for i in client.scan(TableName="test-runs")["Items"] if i["run_id"]["S"].startswith("run-b")]
    assert len(later) == 3
    assert all(EXPIRES not in item for item in later)
