"""The levels of rollups, on both adapters: rolled up as the run moves on, again when a late event lands,
and every window summarized from them with the same numbers as from its events."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infra import template
from shared import rollups
from shared.events import RankEvent
from shared.store.dynamodb import DynamoStore
from shared.store.port import MetricsStore, StoredEvent
from shared.store.sqlite import SqliteStore
from shared.summary import reads
from shared.summary.decoding import decode, units_from_run
from shared.summary.document import Summary, summarize_units
from shared.summary.query import SummaryQuery
from shared.summary.reads import distributed_summary
from shared.summary.rolling import SETTLE_STEPS, roll_up, touched_steps
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
    for i in range(0, len(rank_events), 500):  # batches as clients send them
        assert all(o == "stored" for o in store.put_events(rank_events[i : i + 500]))
    return store


def _close(a: Any, b: Any, rel: float = 1e-12) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=rel)
    return bool(a == b)


def _all_steps(events: list[StoredEvent]) -> set[int]:
    return {e.step for e in events}


def _exact(store: MetricsStore, query: SummaryQuery, size: int) -> Summary:
    """The summary of the window from every stored event, in units of ``size`` steps (one per block of
    that size holding events, as the levels give them)."""
    run = decode(store.read_events("p", "r").events)
    steps = np.unique(run.event_step)
    low, high = query.step_min or 0, query.step_max if query.step_max is not None else 2**62
    steps = steps[(steps >= low) & (steps <= high)]
    blocks = steps // size
    ids = np.unique(blocks)
    world = int(run.event_world_size.max())
    units = units_from_run(run, steps, np.searchsorted(ids, blocks), len(ids), world)
    return summarize_units(units, sorted(run.keys), "p", "r", query)


def _same(got: Mapping[str, Any], exact: Mapping[str, Any]) -> None:
    for field in ("steps", "bin_size", "coverage", "keys", "world_size", "step_min", "step_max"):
        assert got[field] == exact[field], field
    assert _close(got["reducers"], exact["reducers"])
    assert _close(got["heatmap"], exact["heatmap"])
    assert [(r["steps_reported"], r["first_step"], r["last_step"]) for r in got["rank_stats"]] == [
        (r["steps_reported"], r["first_step"], r["last_step"]) for r in exact["rank_stats"]
    ]


@pytest.mark.slow
def test_every_window_read_from_the_levels_has_the_numbers_of_its_events(tmp_path: Path) -> None:
    # The logic over one adapter (the contract suite holds the other to the same reads and writes; a
    # smaller run goes through DynamoDB in the tests below).
    events = synthetic_job(3, 1234, ("stop", "gaps"), keys=2)  # rank 1 stops at step 740
    store = _store(events, SqliteStore(tmp_path / "db"))
    assert touched_steps([("p", "r", 5), ("p", "r", 7), ("p", "q", 5)]) == {
        ("p", "r"): {5, 7},
        ("p", "q"): {5},
    }
    result = roll_up(store, "p", "r", _all_steps(events))
    assert (result.through, result.left) == (1233 - SETTLE_STEPS, 0)
    cases = {
        SummaryQuery(): (1, 177),  # 1,234 steps, 7 to a column
        SummaryQuery(max_steps=100): (10, 62),  # 124 blocks of 10 steps, 2 to a column
        SummaryQuery(max_steps=10): (100, 7),
        SummaryQuery(step_min=15, step_max=1111, max_steps=10): (100, 6),  # cut blocks: finer ones
        SummaryQuery(step_min=105, step_max=999): (1, 179),
        SummaryQuery(step_min=1200): (1, 34),  # steps after the mark: read event by event
    }
    for query, (size, columns) in cases.items():
        got = distributed_summary(store, "p", "r", query)
        assert got is not None
        assert (got["resolution"]["level_steps"], len(got["steps"])) == (size, columns), query
        _same(got, _exact(store, query, size))
        stopped = [(f["rank"], f["severity"]) for f in got["findings"] if f["kind"] == "stopped_reporting"]
        assert stopped == [(1, "critical")], (query, stopped)
    whole = distributed_summary(store, "p", "r", SummaryQuery())
    assert whole is not None
    newest = [e for e in events if e.step > 1233 - SETTLE_STEPS]
    assert whole["resolution"]["events_read"] == len(newest)  # only the steps after the mark
    assert whole["resolution"]["rollup_blocks_read"] == 1234 - SETTLE_STEPS


@pytest.mark.slow
def test_the_items_a_summary_reads_do_not_grow_with_the_runs_length(tmp_path: Path) -> None:
    store: MetricsStore = SqliteStore(tmp_path / "db")
    reads = []
    for steps in (2_000, 20_000):
        job = synthetic_job(2, steps, keys=1, seed=steps)
        store = _store([e._replace(event_id=f"{steps}-{e.event_id}") for e in job], store)
        roll_up(store, "p", "r", _all_steps(job))
        doc = distributed_summary(store, "p", "r", SummaryQuery())
        assert doc is not None
        assert len(doc["steps"]) == 200
        reads.append(doc["resolution"]["rollup_blocks_read"] + doc["resolution"]["events_read"])
    assert reads[1] <= reads[0] + 10, reads


@pytest.mark.slow
def test_a_late_event_behind_the_mark_rolls_its_step_and_the_blocks_above_again(store: MetricsStore) -> None:
    events = synthetic_job(4, 230, keys=1)
    store = _store([e for e in events if not (e.rank == 3 and e.step < 150)], store)
    roll_up(store, "p", "r", _all_steps(events))
    query = SummaryQuery(max_steps=2)
    before = distributed_summary(store, "p", "r", query)
    assert before is not None
    assert before["coverage"]["missing"] == [[3], []]  # steps 0-199, 200-229

    # The same steps named again (another stream shard, a retried batch): read, and nothing written.
    assert roll_up(store, "p", "r", set(range(150))).blocks == 0

    late = [e for e in events if e.rank == 3 and e.step < 150]
    _store(late, store)
    result = roll_up(store, "p", "r", _all_steps(late))
    assert result.events == 4 * 150
    assert result.through == 229 - SETTLE_STEPS
    after = distributed_summary(store, "p", "r", query)
    assert after is not None
    assert after["coverage"]["missing"] == [[], []]
    _same(after, _exact(store, query, 100))
    [block0] = store.read_blocks("p", "r", 100, 0, 0)
    assert block0.n_events == 400
    assert block0.present.tolist() == [100] * 4


def test_combined_levels_equal_a_block_rolled_from_its_events_gaps_included() -> None:
    events = [e for e in synthetic_job(3, 100, ("gaps",), keys=2) if not (e.rank == 1 and e.step in (0, 99))]
    run = decode(events)
    steps = np.unique(run.event_step)
    per_step = units_from_run(run, steps, np.arange(len(steps)), len(steps), 3)
    counts = np.bincount(np.searchsorted(steps, run.event_step))
    level1 = rollups.roll_steps(per_step, counts)
    tens = [rollups.combine(10, b, [p for p in level1 if p.header.block // 10 == b]) for b in range(10)]
    from_tens = rollups.combine(100, 0, tens)
    from_steps = rollups.combine(100, 0, level1)
    whole = units_from_run(run, steps, np.zeros(len(steps), np.int64), 1, 3)
    reported = whole.raw_present
    lead = np.where(whole.present[:, 0] > 0, reported.argmax(axis=1), 0)
    span = np.where(whole.present[:, 0] > 0, len(steps) - reported[:, ::-1].argmax(axis=1) - lead, 0)
    for block in (from_tens, from_steps):
        h = block.header
        assert (h.first_step, h.last_step, h.n_steps, h.n_events) == (0, 99, 100, len(events))
        assert h.present.tolist() == whole.present[:, 0].tolist()
        assert h.first.tolist() == whole.rank_first[:, 0].tolist()
        assert h.last.tolist() == whole.rank_last[:, 0].tolist()
        assert (h.lead.tolist(), h.span.tolist()) == (lead.tolist(), span.tolist())
        for key, k in whole.keys.items():
            total, count, weight, nonfinite = rollups.unpack_key_units(block.sums[key], 3)
            assert np.allclose(total, k.total[:, 0])
            assert count.tolist() == k.count[:, 0].tolist()
            assert np.allclose(weight, k.weight[:, 0])
            assert nonfinite.tolist() == k.nonfinite[:, 0].tolist()
        assert rollups.unpack_header(100, 0, h.packed(), h.keys).present.tolist() == h.present.tolist()


def test_a_rank_that_logged_only_negative_zero_keeps_it_through_the_levels() -> None:
    events = [
        StoredEvent(f"e{s}", s, 0, 1, ["k"], np.array([1.0, s, -0.0], "<f8").tobytes()) for s in range(20)
    ]
    run = decode(events)
    steps = np.unique(run.event_step)
    level1 = rollups.roll_steps(units_from_run(run, steps, np.arange(20), 20, 1), np.ones(20, np.int64))
    total, *_ = rollups.unpack_key_units(rollups.combine(100, 0, level1).sums["k"], 1)
    assert total[0] == 0
    assert np.signbit(total[0])


def test_a_rollup_that_read_fewer_events_never_replaces_one_that_read_more(store: MetricsStore) -> None:
    store = _store(synthetic_job(2, 30, keys=1), store)
    roll_up(store, "p", "r", set(range(30)))
    [header] = store.read_blocks("p", "r", 10, 0, 0)
    assert header.n_events == 20
    two = np.full(2, 10)
    header = rollups.BlockHeader(10, 0, 0, 9, 10, 2, 2, ["train/loss"], two, two * 0, two - 1, two * 0, two)
    stale = rollups.RolledBlock(header, {"train/loss": b"\0" * 48})
    store.write_blocks("p", "r", [stale])
    [kept] = store.read_blocks("p", "r", 10, 0, 0)
    assert (kept.n_events, kept.last_step) == (20, 9)
    assert store.read_block_sums("p", "r", 10, ["train/loss"], 0, 0)["train/loss"][0] != b"\0" * 48


def test_rolling_up_stops_at_its_deadline_and_the_next_call_goes_on(store: MetricsStore) -> None:
    store = _store(synthetic_job(2, 60, keys=1), store)
    late = roll_up(store, "p", "r", {59}, deadline=0.0)  # already past
    assert (late.blocks, late.through) == (0, -1)
    assert late.left >= 1
    assert store.read_blocks("p", "r", 1, 0, 1000) == []
    done = roll_up(store, "p", "r", {59})
    assert (done.through, done.left) == (59 - SETTLE_STEPS, 0)
    assert len(store.read_blocks("p", "r", 1, 0, 1000)) == 60 - SETTLE_STEPS


@pytest.mark.slow
def test_a_run_too_long_to_read_at_once_says_how_far_it_got_until_it_is_rolled_up(
    store: MetricsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "RAW_READ_BUDGET", 400)  # half of the run's 800 events
    store = _store(synthetic_job(4, 200, keys=1), store)
    part = distributed_summary(store, "p", "r", SummaryQuery())
    assert part is not None
    through = part["resolution"]["complete_through_step"]
    assert through is not None
    assert 0 < through < 199
    assert part["step_max"] == through
    partial = [f for f in part["findings"] if f["kind"] == "partial"]
    assert len(partial) == 1
    assert "rolled up in the background" in partial[0]["message"]
    assert [f for f in part["findings"] if f["severity"] != "info"] == []  # no false "stopped" rank

    roll_up(store, "p", "r", set(range(200)))
    whole = distributed_summary(store, "p", "r", SummaryQuery())
    assert whole is not None
    assert whole["resolution"]["complete_through_step"] is None
    assert whole["step_max"] == 199
    assert whole["resolution"]["events_read"] == 4 * SETTLE_STEPS
    assert [f for f in whole["findings"] if f["kind"] == "partial"] == []


@pytest.mark.slow
def test_the_rollup_function_takes_the_tables_stream_records(metrics_table: str) -> None:
    import boto3

    from infra.local import ARN_PREFIX, LambdaContext, lambda_records, load_handler, streams_client

    # Fresh, as a cold start: an earlier import may hold a store bound to a stopped local stack.
    handler = load_handler(template.functions()["RollupFunction"]["Handler"], fresh=True)

    store = _store(synthetic_job(2, 300, keys=1), DynamoStore(metrics_table))
    arn = boto3.client("dynamodb").describe_table(TableName=metrics_table)["Table"]["LatestStreamArn"]
    streams = streams_client()
    shard = streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"][0]["ShardId"]
    iterator = streams.get_shard_iterator(StreamArn=arn, ShardId=shard, ShardIteratorType="TRIM_HORIZON")
    records = streams.get_records(ShardIterator=iterator["ShardIterator"], Limit=1000)["Records"]
    assert len(records) == 600
    result = handler(
        {"Records": lambda_records(records, arn)},
        LambdaContext("RollupFunction", ARN_PREFIX + "RollupFunction"),
    )
    assert result["records"] == 600
    assert [(r["project"], r["run_id"], r["through"], r["left"]) for r in result["runs"]] == [
        ("p", "r", 299 - SETTLE_STEPS, 0)
    ]
    assert [h.block for h in store.read_blocks("p", "r", 100, 0, 10)] == [0, 1, 2]
    assert store.rollup_progress("p", "r").step == 299 - SETTLE_STEPS


def test_packed_sums_round_trip_and_pad_to_a_larger_world() -> None:
    total, weight = np.array([1.5, -2.0]), np.array([3.0, 0.0])
    count, nonfinite = np.array([2, 0]), np.array([0, 1])
    packed = rollups.pack_key_units(total, count, weight, nonfinite)
    assert len(packed) == 2 * 24
    t, c, w, n = rollups.unpack_key_units(packed, 3)
    assert t.tolist() == [1.5, -2.0, 0.0]
    assert c.tolist() == [2, 0, 0]
    assert w.tolist() == [3.0, 0.0, 0.0]
    assert n.tolist() == [0, 1, 0]
