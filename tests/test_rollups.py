"""Per-block rollups over moto: sealed once, then long windows are summarized from them, the same numbers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from shared import rollups, summary
from shared.models import RankEvent
from shared.store import MetricsStore, StoredEvent
from shared.summary import SummaryQuery, distributed_summary
from tests.synthetic import synthetic_job


def _store(events: list[StoredEvent], table: str) -> MetricsStore:
    store = MetricsStore(table)
    for e in events:
        packed = np.frombuffer(e.packed, "<f8")
        store.put_event(
            RankEvent(
                "p", "r", e.event_id, e.step, e.rank, e.world_size, None, float(packed[0]), float(packed[1]),
                tuple(e.keys), tuple(float(v) for v in packed[2:]), b"digest",
            )
        )  # fmt: skip
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


def test_blocks_are_sealed_once_then_read_from_rollups_with_the_same_numbers(
    metrics_table: str, small_budget: None
) -> None:
    store = _store(synthetic_job(4, 500, ("stop",), keys=2), metrics_table)
    query = SummaryQuery(max_steps=5)  # columns of 100 steps: the block size
    exact = distributed_summary(store, "p", "r", query)
    assert exact is not None and exact["resolution"]["unit"] == "step"
    # Rank 1 stops at step 299: blocks 0-2 are complete, 3 is not, 4 is the live edge.
    assert exact["resolution"]["blocks_sealed"] == 3

    rolled = distributed_summary(store, "p", "r", query)
    assert rolled is not None
    assert rolled["resolution"] == {
        "unit": "block",
        "block_steps": rollups.BLOCK_STEPS,
        "rollup_blocks_read": 3,
        "events_read": 3 * 200,  # blocks 3 and 4 (steps 300-499), where rank 1 is absent
        "blocks_sealed": 0,
        "complete_through_step": None,
    }
    for field in ("steps", "bin_size", "coverage", "keys", "world_size", "step_min", "step_max"):
        assert rolled[field] == exact[field], field
    assert _close(rolled["reducers"], exact["reducers"])
    assert _close(rolled["heatmap"], exact["heatmap"])
    assert [(r["steps_reported"], r["first_step"], r["last_step"]) for r in rolled["rank_stats"]] == [
        (r["steps_reported"], r["first_step"], r["last_step"]) for r in exact["rank_stats"]
    ]
    stopped = [f for f in rolled["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["step"], f["severity"]) for f in stopped] == [(1, 299, "critical")]


def test_a_window_that_cuts_blocks_reads_its_edges_event_by_event(
    metrics_table: str, small_budget: None
) -> None:
    store = _store(synthetic_job(2, 600, keys=1), metrics_table)
    distributed_summary(store, "p", "r", SummaryQuery())  # seals blocks 0-4
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


def test_a_run_too_long_to_read_at_once_is_rolled_up_a_part_per_summary(
    metrics_table: str, small_budget: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summary, "RAW_READ_BUDGET", 16 * 250)  # 250 items a shard: one rank a shard here
    store = _store(synthetic_job(4, 500, keys=1), metrics_table)
    seen = []
    for _ in range(3):
        part = distributed_summary(store, "p", "r", SummaryQuery())
        assert part is not None
        resolution = part["resolution"]
        seen.append((resolution["unit"], resolution["complete_through_step"], resolution["blocks_sealed"]))
        partial = [f for f in part["findings"] if f["kind"] == "partial"]
        assert len(partial) == (resolution["complete_through_step"] is not None)
        assert [f for f in part["findings"] if f["severity"] != "info"] == []  # no stopped ranks
        assert part["step_max"] == (resolution["complete_through_step"] or 499)
    assert seen == [("step", 249, 2), ("block", 449, 2), ("block", None, 0)]


def test_raw_intervals_skip_sealed_blocks() -> None:
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
