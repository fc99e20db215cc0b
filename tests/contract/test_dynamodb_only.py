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

    from shared.store.dynamodb import EXPIRES, RUNS_INDEX, listing_shard, scalar_partition
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
        KeyConditionExpression="#lsh = :p",
        ExpressionAttributeNames={"#lsh": "listing_shard"},
        ExpressionAttributeValues={":p": {"S": listing_shard(PROJECT, RUN)}},
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


def test_each_run_s_items_have_a_partition_of_their_own_and_a_project_s_runs_list_across_shards(
    metrics_table: str,
) -> None:
    """Issue 41: no partition key of the runs table is shared by two runs of a project (with the project
    as the key, about 17 live 512-rank runs filled one partition), and the listing merges the shards
    newest first, a page at a time."""
    import boto3

    from shared.store.dynamodb import listing_shard
    from shared.store.port import RunActivity

    store = DynamoStore(metrics_table, runs_table="test-runs")
    runs = [f"run-{n:02d}" for n in range(20)]
    for n, run in enumerate(runs):
        store.note_activity(PROJECT, run, RunActivity(1000.0 + n, 5, frozenset({n, 40 + n}), 64))
        store.update_run(PROJECT, run, 1000.0 + n, config=f'{{"n": {n}}}')
        store.update_process(PROJECT, run, 0, lambda _: '{"state": "started"}')
    items = boto3.client("dynamodb").scan(TableName="test-runs")["Items"]
    partitions: dict[str, set[str]] = {}
    for item in items:
        partitions.setdefault(item["project"]["S"], set()).add(item["run_id"]["S"].partition("#")[0][:6])
    assert sorted(partitions) == sorted(f"{PROJECT}#{run}" for run in runs)
    assert all(len(owners) == 1 for owners in partitions.values())  # its own, config, groups, process
    assert len({listing_shard(PROJECT, run) for run in runs}) > 1  # the listing reads several shards

    first = store.list_runs(PROJECT, 7)
    assert [r.run_id for r in first] == runs[::-1][:7]
    rest = store.list_runs(PROJECT, 50, after=(first[-1].last_event, first[-1].run_id))
    assert [r.run_id for r in first + rest] == runs[::-1]
    assert [r.config for r in rest[-2:]] == ['{"n": 1}', '{"n": 0}']
    assert store.processes(PROJECT, "run-03") == {0: '{"state": "started"}'}


def test_a_run_recorded_in_the_earlier_layout_is_still_read_listed_watched_and_listed_once_when_live(
    metrics_table: str,
) -> None:
    """Runs stored before run partitions (their items in the project's partition, listed by
    ``by_activity``) are read there: a deployment updated in place loses none of its runs."""
    import boto3

    from shared.store.dynamodb import watch_shard
    from shared.store.port import RunActivity

    client = boto3.client("dynamodb")
    now = 2000.0
    store = DynamoStore(metrics_table, runs_table="test-runs", clock=lambda: now)

    def legacy(item_id: str, **attributes: dict[str, str]) -> None:
        client.put_item(
            TableName="test-runs",
            Item={"project": {"S": PROJECT}, "run_id": {"S": item_id}, **attributes},
        )

    for run, at in (("old-a", "1990.0"), ("old-b", "1995.0")):
        legacy(
            run,
            created={"N": "1900.0"},
            last_event={"N": at},
            received={"N": at},
            watch_shard={"S": watch_shard(PROJECT, run)},
        )
        legacy(f"{run}#config", config={"S": '{"old": true}'})
        legacy(f"{run}#s00", s3={"N": "41"}, w3={"N": "4"})
    legacy("old-a$p003", doc={"S": '{"state": "ended"}'}, version={"N": "1"})
    store.note_activity(PROJECT, "new-c", RunActivity(1998.0, 7, frozenset({0}), 1))

    old = store.get_run(PROJECT, "old-a")
    assert old is not None
    assert (old.created, old.last_event, old.last_step, old.config) == (1900.0, 1990.0, 41, '{"old": true}')
    assert store.processes(PROJECT, "old-a") == {3: '{"state": "ended"}'}
    assert [r.run_id for r in store.list_runs(PROJECT, 10)] == ["new-c", "old-b", "old-a"]
    watched = store.watched_runs(0.0, 10)
    assert [(p, r.run_id, r.last_step) for p, r in watched] == [
        (PROJECT, "new-c", 7),
        (PROJECT, "old-b", 41),
        (PROJECT, "old-a", 41),
    ]

    # old-b goes on after the update: its new activity is in its own partition, and it is listed once.
    store.note_activity(PROJECT, "old-b", RunActivity(1999.0, 42, frozenset({3}), 4))
    listed = store.list_runs(PROJECT, 10)
    assert [(r.run_id, r.last_event) for r in listed] == [
        ("old-b", 1999.0),
        ("new-c", 1998.0),
        ("old-a", 1990.0),
    ]
    assert [r.run_id for _, r in store.watched_runs(0.0, 10)] == ["old-b", "new-c", "old-a"]


def test_a_run_s_indexed_item_changes_about_once_a_second_however_many_ingest_instances_note_it(
    metrics_table: str,
) -> None:
    """Each store below is an ingest instance that has not seen the run before (a team's hundred runs
    reach hundreds of instances): a note with a step part within ``run_time_resolution_s`` of the
    recorded time leaves the run's own item (and so both indexes) as it is; its step part is written."""
    from shared.store.port import RunActivity

    instances = [DynamoStore(metrics_table, runs_table="test-runs") for _ in range(20)]
    assert instances[0].run_time_resolution_s == 1.0
    t0 = 1_800_000_000.0
    for n, store in enumerate(instances):
        store.note_activity(PROJECT, RUN, RunActivity(t0 + n * 0.04, n, frozenset({n}), 32))
    record = instances[0].get_run(PROJECT, RUN)
    assert record is not None
    assert (record.last_event, record.last_step, record.ranks_reporting) == (t0, 19, 1)

    instances[5].note_activity(PROJECT, RUN, RunActivity(t0 + 1.0, 20, frozenset({3}), 32))
    record = instances[7].get_run(PROJECT, RUN)
    assert record is not None and (record.last_event, record.last_step) == (t0 + 1.0, 20)
    # A time alone (scalars, no step part) is never held back.
    instances[9].note_activity(PROJECT, RUN, RunActivity(t0 + 1.5))
    record = instances[9].get_run(PROJECT, RUN)
    assert record is not None and record.last_event == t0 + 1.5
