"""The reducers and coverage against values computed by hand and by plain numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared import stats
from shared.store import StoredEvent
from shared.summary import SummaryQuery, decode, summarize

nan = math.nan


def test_reducers_by_hand_with_a_gap() -> None:
    # 3 ranks x 2 steps; rank 2 did not report step 1.
    values = np.array([[1.0, 2.0], [3.0, 4.0], [8.0, nan]])
    weights = np.array([[1.0, 1.0], [1.0, 3.0], [2.0, 0.0]])
    red = stats.reducers(values, weights)
    assert red.count.tolist() == [3, 2]
    assert red.mean.tolist() == [4.0, 3.0]
    assert red.weighted_mean.tolist() == [(1 + 3 + 16) / 4, (2 + 12) / 4]
    assert (
        red.min.tolist() == [1.0, 2.0] and red.max.tolist() == [8.0, 4.0] and red.range.tolist() == [7.0, 2.0]
    )
    assert red.std[0] == pytest.approx(math.sqrt(((1 - 4) ** 2 + (3 - 4) ** 2 + (8 - 4) ** 2) / 3))
    assert red.std[1] == 1.0
    assert red.p50.tolist() == [3.0, 3.0]
    assert red.p05[0] == pytest.approx(1.2) and red.p95[1] == pytest.approx(3.9)


def test_zero_weights_and_empty_columns_give_no_value() -> None:
    values = np.array([[1.0, nan], [2.0, nan]])
    red = stats.reducers(values, np.zeros((2, 2)))
    assert math.isnan(red.weighted_mean[0]) and red.mean[0] == 1.5
    assert red.count[1] == 0
    assert all(math.isnan(getattr(red, n)[1]) for n in ("mean", "min", "max", "std", "p05", "p50", "p95"))


def test_percentiles_match_numpy_default_method() -> None:
    rng = np.random.default_rng(7)
    values = rng.normal(size=(37, 50))
    values[rng.random(values.shape) < 0.2] = nan
    count = (~np.isnan(values)).sum(axis=0)
    for q, got in zip(stats.PERCENTILES, stats.percentiles(values, count, stats.PERCENTILES), strict=True):
        np.testing.assert_allclose(got, np.nanpercentile(values, q, axis=0), rtol=1e-12)


def test_binning_averages_each_rank_and_sums_weights() -> None:
    values = np.array([[1.0, 3.0, 5.0], [2.0, nan, 4.0]])
    weights = np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    binned, w = stats.bin_columns(values, weights, 2)
    assert binned.tolist() == [[2.0, 5.0], [2.0, 4.0]]
    assert w.tolist() == [[2.0, 1.0], [2.0, 2.0]]


def test_one_rank_far_from_seven_agreeing_ranks_is_flagged() -> None:
    values = np.array([[1.0], [1.01], [0.99], [1.0], [1.02], [0.98], [1.0], [9.0]])
    score = stats.robust_scores(values)
    assert abs(score[7, 0]) > stats.DEFAULT_OUTLIER_THRESHOLD
    assert np.all(np.abs(score[:7, 0]) < stats.DEFAULT_OUTLIER_THRESHOLD)
    assert stats.zscores(values, values.mean(axis=0), values.std(axis=0))[7, 0] < 3  # plain z cannot


def _event(
    event_id: str, step: int, rank: int, value: float, time: float, world_size: int = 2
) -> StoredEvent:
    packed = np.array([1.0, time, value], "<f8").tobytes()
    return StoredEvent(event_id, step, rank, world_size, ["k"], packed)


def test_the_later_event_wins_a_same_step_rank_key_and_counts_once() -> None:
    events = [
        _event("b", 0, 0, 5.0, time=2.0),
        _event("a", 0, 0, 1.0, time=1.0),
        _event("c", 0, 1, 7.0, time=1.0),
        _event("d", 0, 1, 3.0, time=1.0),  # same time: the larger event id wins
    ]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert summary["reducers"]["k"]["count"] == [2]
    assert summary["heatmap"]["k"]["values"] == [[5.0], [3.0]]


def test_coverage_follows_an_elastic_world_size() -> None:
    events = [_event("a", 0, 0, 1.0, 1.0, world_size=2), _event("b", 0, 1, 1.0, 1.0, world_size=2)]
    events += [_event(f"c{r}", 1, r, 1.0, 1.0, world_size=4) for r in (0, 1, 3)]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert summary["coverage"] == {"expected": [2, 4], "reported": [2, 3], "missing": [[], [2]]}
