"""What only the DynamoDB adapter does: its documented quirk (the docstring of
shared/store/dynamodb/__init__.py).

An event id is unique per (run, shard, step), not per run: the same id sent again with another step,
or with a rank in another shard, is a different item and is stored as a second event rather than
refused. A genuine retry resends the same body, so it always lands on the same item."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shared.errors import EventIdReused
from shared.events import RankEvent, ScalarEvent
from shared.ingest.bodies import validate_body
from shared.ingest.parse import to_event
from shared.store.dynamodb import SHARDS, DynamoStore
from shared.summary.query import SummaryQuery
from shared.summary.reads import distributed_summary

PROJECT = "proj"
RUN = "run-a"


@pytest.fixture
def store(metrics_table: str, atomic_moto_puts: None) -> Iterator[DynamoStore]:
    yield DynamoStore(metrics_table)


def _event(step: int, rank: int, value: float, event_id: str = "the-id") -> RankEvent:
    body = {"step": step, "rank": rank, "world_size": 32, "metrics": {"train/loss": value}, "time": 1.0}
    return to_event(PROJECT, RUN, validate_body(body), event_id, 0.0)


def _events(store: DynamoStore) -> list[tuple[str, int, int]]:
    return sorted((e.event_id, e.step, e.rank) for e in store.read_events(PROJECT, RUN).events)


@pytest.mark.slow
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
    e = _event(1, 0, 0.5, "a-scalar")
    keeping.put_scalars(
        [ScalarEvent(PROJECT, RUN, e.event_id, 1, 0, e.time, e.keys, e.values, e.payload_digest)]
    )
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


def _level10_block(block: int, ranks: int, n_events: int, value: float) -> Any:
    """A rolled level-10 block of one key ("loss"), every rank at every step, each rank's sum ``value``
    plus its rank (so that every block and rank differs)."""
    import numpy as np

    from shared.rollups import BlockHeader, RolledBlock, pack_key_units

    first = block * 10
    every = np.full(ranks, 10, np.int64)
    header = BlockHeader(
        10,
        block,
        first,
        first + 9,
        10,
        ranks,
        n_events,
        ["loss"],
        every,
        np.full(ranks, first, np.int64),
        np.full(ranks, first + 9, np.int64),
        np.zeros(ranks, np.int64),
        every,
    )
    total = value + np.arange(ranks) / 7
    sums = pack_key_units(total, every, every.astype(np.float64), np.zeros(ranks, np.int64))
    return RolledBlock(header, {"loss": sums})


def _sum_items_read(store: DynamoStore) -> list[int]:
    """Counts, per Query of a key's sums partition, the items DynamoDB answered."""
    from shared.store.dynamodb import ROLLUP_PREFIX

    counts: list[int] = []

    def count(params: dict[str, Any], parsed: dict[str, Any], **_: Any) -> None:
        pk = params.get("ExpressionAttributeValues", {}).get(":pk", {}).get("S", "")
        if pk.startswith(ROLLUP_PREFIX) and pk.count("#") >= 3:  # @rollup#project#run#key
            counts.append(len(parsed.get("Items", [])))

    def keep_params(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["query_params"] = params

    store.client.meta.events.register("provide-client-params.dynamodb.Query", keep_params)
    store.client.meta.events.register(
        "after-call.dynamodb.Query",
        lambda http_response, parsed, model, context, **kw: count(context["query_params"], parsed),
    )
    return counts


def test_rolled_sums_are_stored_compressed_and_read_back_bit_for_bit(store: DynamoStore) -> None:
    """A key's sums are written zlib-compressed (``vz``): a third of the write units at 512 ranks; any
    store reads the same bytes back, and sums written plain (``v``) before are still read."""
    import boto3

    from shared.store.dynamodb import block_sort_key, key_partition

    block = _level10_block(0, 512, 5120, 3.25)
    store.write_blocks(PROJECT, RUN, [block])
    client = boto3.client("dynamodb")
    item = client.get_item(
        TableName=store.table_name,
        Key={"pk": {"S": key_partition(PROJECT, RUN, "loss")}, "sk": {"S": block_sort_key(10, 0)}},
    )["Item"]
    assert "v" not in item and len(item["vz"]["B"]) < len(block.sums["loss"]) / 2
    fresh = DynamoStore(store.table_name)
    fresh.read_blocks(PROJECT, RUN, 10, 0, 0)
    assert fresh.read_block_sums(PROJECT, RUN, 10, ["loss"], 0, 0) == {"loss": {0: block.sums["loss"]}}

    old = _level10_block(1, 8, 80, -1.5)
    store.write_blocks(PROJECT, RUN, [old])
    client.put_item(  # as the adapter wrote a key's sums before they were compressed
        TableName=store.table_name,
        Item={
            "pk": {"S": key_partition(PROJECT, RUN, "loss")},
            "sk": {"S": block_sort_key(10, 1)},
            "v": {"B": old.sums["loss"]},
            "n": {"N": "80"},
        },
    )
    other = DynamoStore(store.table_name)
    other.read_blocks(PROJECT, RUN, 10, 0, 1)
    assert other.read_block_sums(PROJECT, RUN, 10, ["loss"], 0, 1)["loss"][1] == old.sums["loss"]


def test_a_warm_store_reads_again_only_the_sums_of_blocks_rolled_up_since(store: DynamoStore) -> None:
    """The summarize function's refresh of a long run: the blocks' headers are read every time, a key's
    sums only for blocks that are new or were rolled up again from more events since this store read
    them; what it answers is what a fresh store reads."""
    roller = DynamoStore(store.table_name)
    roller.write_blocks(PROJECT, RUN, [_level10_block(b, 16, 160, float(b)) for b in range(6)])
    reader = DynamoStore(store.table_name)
    counts = _sum_items_read(reader)

    def read(first: int, last: int) -> dict[int, bytes]:
        reader.read_blocks(PROJECT, RUN, 10, first, last)
        return reader.read_block_sums(PROJECT, RUN, 10, ["loss"], first, last)["loss"]

    def truth(first: int, last: int) -> dict[int, bytes]:
        fresh = DynamoStore(store.table_name)
        fresh.read_blocks(PROJECT, RUN, 10, first, last)
        return fresh.read_block_sums(PROJECT, RUN, 10, ["loss"], first, last)["loss"]

    assert read(0, 5) == truth(0, 5) and sum(counts) == 6
    counts.clear()
    assert read(0, 5) == truth(0, 5) and sum(counts) == 0  # nothing changed: nothing read

    # Block 2 rolled up again from more events (a late rank), block 6 new, block 4 rewritten by a
    # roller that read fewer events (refused by its condition: the stored one stays).
    roller.write_blocks(
        PROJECT,
        RUN,
        [_level10_block(2, 16, 161, 20.5), _level10_block(6, 16, 160, 6.0), _level10_block(4, 16, 100, 9.0)],
    )
    counts.clear()
    got = read(0, 6)
    assert got == truth(0, 6) and sum(counts) == 2
    assert got[2] == _level10_block(2, 16, 161, 20.5).sums["loss"]
    assert got[4] == _level10_block(4, 16, 160, 4.0).sums["loss"]
    counts.clear()
    assert read(3, 6) == truth(3, 6) and sum(counts) == 0
