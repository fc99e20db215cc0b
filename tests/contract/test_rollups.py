"""Per-block rollups, on both adapters: rolled up as the run moves on, again when a late event lands, and long
windows summarized from them with the same numbers as from the events."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from infra import template
from shared import rollups, summary
from shared.models import RankEvent
from shared.query import SummaryQuery
from shared.rolling import roll_up, touched_blocks
from shared.store.dynamodb import DynamoStore
from shared.store.port import MetricsStore, StoredEvent
from shared.summary import distributed_summary
from tests.synthetic import synthetic_job


def _store(events: list[StoredEvent], store: MetricsStore) -> MetricsStore:
    rank_events = []
    for e in events:
        packed = np.frombuffer(e.packed, "<f8")
        rank_events.append(
            RankEvent(
                "p", "r", e.event_id, e.step, e.rank, e.world_size, None, float(packed[0]), float(packed[1]),
                tuple(e.keys), tuple(float(v) for v in packed[2:]), b"digest",
            )
        )  # fmt: skip
    assert all(o == "stored" for o in store.put_events(rank_events))
    return store


def _close(a: Any, b: Any, rel: float = 1e-12) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=rel)
    return bool(a == b)


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summary, "RAW_EVENT_BUDGET", 500)


def _exact(store: MetricsStore, query: SummaryQuery, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The summary from every event, one by one (rollups ignored)."""
    with monkeypatch.context() as m:
        m.setattr(summary, "RAW_EVENT_BUDGET", 10**9)
        exact = distributed_summary(store, "p", "r", query)
    assert exact is not None and exact["resolution"]["unit"] == "step"
    return exact


def _same(rolled: dict[str, Any], exact: dict[str, Any]) -> None:
    for field in ("steps", "bin_size", "coverage", "keys", "world_size", "step_min", "step_max"):
        assert rolled[field] == exact[field], field
    assert _close(rolled["reducers"], exact["reducers"])
    assert _close(rolled["heatmap"], exact["heatmap"])
    assert [(r["steps_reported"], r["first_step"], r["last_step"]) for r in rolled["rank_stats"]] == [
        (r["steps_reported"], r["first_step"], r["last_step"]) for r in exact["rank_stats"]
    ]


def test_blocks_the_run_moved_past_are_rolled_up_and_give_the_same_numbers(
    store: MetricsStore, small_budget: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(synthetic_job(4, 500, ("stop",), keys=2), store)
    query = SummaryQuery(max_steps=5)  # columns of 100 steps: the block size
    exact = _exact(store, query, monkeypatch)
    # Rank 1 stops at step 299. Events landed in blocks 0-4: 0-3 are behind the run, 4 is being written.
    assert touched_blocks([("p", "r", 5), ("p", "r", 499)]) == {("p", "r"): {0, 4}}
    result = roll_up(store, "p", "r", {0, 4})
    assert (result.blocks, result.through, result.left, result.events) == (4, 3, 0, 4 * 300 + 3 * 100)

    rolled = distributed_summary(store, "p", "r", query)
    assert rolled is not None
    assert rolled["resolution"] == {
        "unit": "block",
        "block_steps": rollups.BLOCK_STEPS,
        "rollup_blocks_read": 4,
        "events_read": 3 * 100,  # block 4 (steps 400-499), where rank 1 is absent
        "complete_through_step": None,
    }
    _same(rolled, exact)
    stopped = [f for f in rolled["findings"] if f["kind"] == "stopped_reporting"]
    assert stopped == [f for f in exact["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["step"], f["severity"]) for f in stopped] == [(1, 299, "critical")]
    assert "200 steps behind" in stopped[0]["message"]  # 100 in rolled-up block 3, 100 read one by one

    # Nothing new: a second call has nothing due.
    again = roll_up(store, "p", "r", {4})
    assert (again.blocks, again.through) == (0, 3)


def test_a_late_event_in_a_rolled_block_rolls_it_up_again(
    store: MetricsStore, small_budget: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = synthetic_job(4, 500, ("stop",), keys=1)
    store = _store(events, store)
    roll_up(store, "p", "r", {4})
    late = next(e for e in events if e.rank == 1 and e.step == 0)
    _store([StoredEvent("late-350", 350, 1, 4, late.keys, late.packed)], store)
    # The stream names the late event's block: 3, behind the rolled-up frontier.
    result = roll_up(store, "p", "r", touched_blocks([("p", "r", 350)])[("p", "r")])
    assert (result.blocks, result.events) == (1, 3 * 100 + 1)

    query = SummaryQuery(max_steps=5)
    rolled = distributed_summary(store, "p", "r", query)
    assert rolled is not None and rolled["resolution"]["rollup_blocks_read"] == 4
    exact = _exact(store, query, monkeypatch)
    _same(rolled, exact)
    assert rolled["rank_stats"][1]["last_step"] == 350
    gaps = [f for f in rolled["findings"] if f["kind"] == "missing_steps"]
    assert [(f["rank"], f["step"]) for f in gaps] == [(1, 300)]
    assert "missed 50 of the 351 steps between steps 0 and 350" in gaps[0]["message"]
    assert "50 in rolled-up blocks from step 300" in gaps[0]["message"]
    exact_gaps = [f for f in exact["findings"] if f["kind"] == "missing_steps"]
    assert "missed 50 of the 351 steps between steps 0 and 350" in exact_gaps[0]["message"]


def test_a_rollup_that_read_fewer_events_never_replaces_one_that_read_more(store: MetricsStore) -> None:
    store = _store(synthetic_job(2, 200, keys=1), store)
    roll_up(store, "p", "r", {1})
    rollup_store = store
    [header] = rollup_store.read_blocks("p", "r", 0, 0)
    assert header.n_events == 200
    two = np.full(2, 10)
    header = rollups.BlockHeader(0, 0, 9, 10, 2, 20, ["train/loss"], two, two * 0, two - 1, two * 0, two)
    stale = rollups.RolledBlock(header, {"train/loss": b"\0" * 48})
    rollup_store.write_blocks("p", "r", [stale])
    [kept] = rollup_store.read_blocks("p", "r", 0, 0)
    assert (kept.n_events, kept.last_step) == (200, 99)
    assert len(rollup_store.read_block_sums("p", "r", ["train/loss"], 0, 0)["train/loss"][0]) == 2 * 24
    assert rollup_store.read_block_sums("p", "r", ["train/loss"], 0, 0)["train/loss"][0] != b"\0" * 48


def test_rolling_up_stops_at_its_deadline_and_the_next_call_goes_on(store: MetricsStore) -> None:
    store = _store(synthetic_job(2, 400, keys=1), store)
    late = roll_up(store, "p", "r", {3}, deadline=0.0)  # already past
    assert (late.blocks, late.through) == (0, -1) and late.left >= 1
    assert store.read_blocks("p", "r", 0, 10) == []
    done = roll_up(store, "p", "r", {3})
    assert (done.blocks, done.through, done.left) == (3, 2, 0)


def test_a_window_that_cuts_blocks_reads_its_edges_event_by_event(
    store: MetricsStore, small_budget: None
) -> None:
    store = _store(synthetic_job(2, 600, keys=1), store)
    roll_up(store, "p", "r", {5})  # blocks 0-4
    window = distributed_summary(store, "p", "r", SummaryQuery(step_min=50, step_max=449, max_steps=1000))
    assert window is not None
    assert window["resolution"]["unit"] == "block" and window["resolution"]["rollup_blocks_read"] == 3
    assert window["resolution"]["events_read"] == 2 * (50 + 50)
    assert window["steps"] == [50, 100, 200, 300, 400]
    assert [r["steps_reported"] for r in window["rank_stats"]] == [400, 400]
    assert window["coverage"]["reported"] == [2] * 5
    assert window["reducers"]["train/loss"]["count"] == [2] * 5
    assert [f for f in window["findings"] if f["severity"] != "info"] == []

    only_rollups = distributed_summary(store, "p", "r", SummaryQuery(step_max=399))
    assert only_rollups is not None
    assert only_rollups["resolution"]["events_read"] == 0
    assert only_rollups["steps"] == [0, 100, 200, 300]
    assert only_rollups["rank_stats"][1]["last_step"] == 399


def test_a_run_too_long_to_read_at_once_says_how_far_it_got_until_it_is_rolled_up(
    store: MetricsStore, small_budget: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summary, "RAW_READ_BUDGET", 1000)  # half of the run's 2,000 events
    store = _store(synthetic_job(4, 500, keys=1), store)
    part = distributed_summary(store, "p", "r", SummaryQuery())
    assert part is not None
    through = part["resolution"]["complete_through_step"]
    assert through is not None and 0 < through < 499 and part["step_max"] == through
    partial = [f for f in part["findings"] if f["kind"] == "partial"]
    assert len(partial) == 1 and "rolled up in the background" in partial[0]["message"]
    assert [f for f in part["findings"] if f["severity"] != "info"] == []  # no false "stopped" rank

    roll_up(store, "p", "r", {4})
    monkeypatch.setattr(summary, "RAW_READ_BUDGET", 16 * 250)  # the block being written fits (DynamoDB:
    whole = distributed_summary(store, "p", "r", SummaryQuery())  # the budget is split over 16 shards)
    assert whole is not None
    assert whole["resolution"]["complete_through_step"] is None and whole["step_max"] == 499
    assert (whole["resolution"]["unit"], whole["resolution"]["rollup_blocks_read"]) == ("block", 4)
    assert [f for f in whole["findings"] if f["kind"] == "partial"] == []


def test_the_rollup_function_takes_the_tables_stream_records(metrics_table: str) -> None:
    import boto3

    from infra.local import LambdaContext, lambda_records, load_handler, streams_client

    # Fresh, as a cold start: an earlier import may hold a store bound to a stopped local stack.
    handler = load_handler(template.functions()["RollupFunction"]["Handler"], fresh=True)

    store = _store(synthetic_job(2, 300, keys=1), DynamoStore(metrics_table))
    arn = boto3.client("dynamodb").describe_table(TableName=metrics_table)["Table"]["LatestStreamArn"]
    streams = streams_client()
    shard = streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"][0]["ShardId"]
    iterator = streams.get_shard_iterator(StreamArn=arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")
    records = streams.get_records(ShardIterator=iterator["ShardIterator"], Limit=1000)["Records"]
    assert len(records) == 600
    result = handler({"Records": lambda_records(records, arn)}, LambdaContext("RollupFunction"))
    assert result["records"] == 600
    assert [(r["project"], r["run_id"], r["blocks"], r["through"]) for r in result["runs"]] == [
        ("p", "r", 2, 1)
    ]
    assert [h.block for h in store.read_blocks("p", "r", 0, 10)] == [0, 1]


def test_raw_intervals_skip_rolled_blocks() -> None:
    assert summary._raw_intervals(0, None, []) == [(0, None)]
    assert summary._raw_intervals(50, 449, [1, 2, 3]) == [(50, 99), (400, 449)]
    assert summary._raw_intervals(0, 299, [0, 1, 2]) == []
    assert summary._raw_intervals(0, None, [0, 2]) == [(100, 199), (300, None)]


def test_packed_sums_round_trip_and_pad_to_a_larger_world() -> None:
    total, weight = np.array([1.5, -2.0]), np.array([3.0, 0.0])
    count, nonfinite = np.array([2, 0]), np.array([0, 1])
    packed = rollups.pack_key_units(total, count, weight, nonfinite)
    assert len(packed) == 2 * 24
    t, c, w, n = rollups.unpack_key_units(packed, 3)
    assert t.tolist() == [1.5, -2.0, 0.0] and c.tolist() == [2, 0, 0]
    assert w.tolist() == [3.0, 0.0, 0.0] and n.tolist() == [0, 1, 0]
