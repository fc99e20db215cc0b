"""The reducers and coverage against values computed by hand and by plain numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared import stats
from shared.store.port import StoredEvent
from shared.summary.decoding import decode, decode_steps
from shared.summary.document import summarize
from shared.summary.query import SummaryQuery

nan = math.nan


def test_reducers_by_hand_with_a_gap() -> None:
    # 3 ranks x 2 steps; rank 2 did not report step 1.
    values = np.array([[1.0, 2.0], [3.0, 4.0], [8.0, nan]])
    weights = np.array([[1.0, 1.0], [1.0, 3.0], [2.0, 0.0]])
    red = stats.reducers(values, weights)
    assert red.count.tolist() == [3, 2]
    assert red.mean.tolist() == [4.0, 3.0]
    assert red.weighted_mean.tolist() == [(1 + 3 + 16) / 4, (2 + 12) / 4]
    assert red.min.tolist() == [1.0, 2.0]
    assert red.max.tolist() == [8.0, 4.0]
    assert red.range.tolist() == [7.0, 2.0]
    assert red.std[0] == pytest.approx(math.sqrt(((1 - 4) ** 2 + (3 - 4) ** 2 + (8 - 4) ** 2) / 3))
    assert red.std[1] == 1.0
    assert red.p50.tolist() == [3.0, 3.0]
    assert red.p05[0] == pytest.approx(1.2)
    assert red.p95[1] == pytest.approx(3.9)


def test_zero_weights_and_empty_columns_give_no_value() -> None:
    values = np.array([[1.0, nan], [2.0, nan]])
    red = stats.reducers(values, np.zeros((2, 2)))
    assert math.isnan(red.weighted_mean[0])
    assert red.mean[0] == 1.5
    assert red.count[1] == 0
    assert all(math.isnan(getattr(red, n)[1]) for n in ("mean", "min", "max", "std", "p05", "p50", "p95"))


def test_percentiles_match_numpy_default_method() -> None:
    rng = np.random.default_rng(7)
    values = rng.normal(size=(37, 50))
    values[rng.random(values.shape) < 0.2] = nan
    count = (~np.isnan(values)).sum(axis=0)
    for q, got in zip(stats.PERCENTILES, stats.percentiles(values, count, stats.PERCENTILES), strict=True):
        np.testing.assert_allclose(got, np.nanpercentile(values, q, axis=0), rtol=1e-12)


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


def test_one_rank_two_ranks_and_all_equal_by_hand() -> None:
    one = stats.reducers(np.array([[2.5, nan]]), np.array([[4.0, 1.0]]))
    assert (one.count.tolist(), one.mean[0], one.weighted_mean[0], one.std[0]) == ([1, 0], 2.5, 2.5, 0.0)
    assert (one.p05[0], one.p50[0], one.p95[0], one.range[0]) == (2.5, 2.5, 2.5, 0.0)
    two = stats.reducers(np.array([[1.0], [3.0]]), np.array([[3.0], [1.0]]))
    assert (two.mean[0], two.weighted_mean[0], two.std[0]) == (2.0, 1.5, 1.0)
    assert (two.p05[0], two.p50[0], two.p95[0]) == pytest.approx((1.1, 2.0, 2.9))
    same = np.full((8, 3), 0.25)
    red = stats.reducers(same, np.ones_like(same))
    assert red.std.tolist() == [0.0] * 3
    assert red.range.tolist() == [0.0] * 3
    assert np.all(stats.zscores(same, red.mean, red.std) == 0)  # 0 when std is 0
    assert np.all(stats.robust_scores(same) == 0)  # MAD and MeanAD both 0


def test_robust_score_falls_back_to_mean_absolute_deviation_when_mad_is_zero() -> None:
    values = np.array([[1.0], [1.0], [1.0], [1.0], [1.0], [3.0]])
    score = stats.robust_scores(values)
    mean_ad = 2.0 / 6
    assert score[5, 0] == pytest.approx(2.0 / (stats.MEAN_AD_SCALE * mean_ad))
    assert score[:5, 0].tolist() == [0.0] * 5


def test_a_nan_is_counted_and_kept_out_of_every_reducer() -> None:
    events = [_event("a", 0, 0, nan, 1.0), _event("b", 0, 1, 2.0, 1.0)]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    loss = summary["reducers"]["k"]
    assert (loss["count"], loss["nonfinite"], loss["mean"], loss["std"]) == ([1], [1], [2.0], [0.0])
    assert summary["heatmap"]["k"]["values"] == [[None], [2.0]]
    assert [(f["kind"], f["rank"]) for f in summary["findings"]] == [("nonfinite", 0)]


def test_a_gap_is_missing_coverage_and_null_in_the_heatmap() -> None:
    events = [_event(f"a{s}", s, 0, 1.0, s) for s in range(3)]
    events += [_event(f"b{s}", s, 1, 2.0, s) for s in (0, 2)]
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    assert summary["coverage"]["missing"] == [[], [1], []]
    assert summary["heatmap"]["k"]["values"][1] == [2.0, None, 2.0]
    assert summary["reducers"]["k"]["count"] == [2, 1, 2]
    gaps = [f for f in summary["findings"] if f["kind"] == "missing_steps"]
    assert [(f["rank"], f["step"]) for f in gaps] == [(1, 1)]


def test_scores_are_z_and_the_outlier_score_of_the_method_asked() -> None:
    values = np.array([[1.0, 2.0], [1.0, 2.5], [1.0, 9.0], [1.2, nan]])
    red = stats.reducers(values, np.ones_like(values))

    z, robust = stats.scores(values, red, "modified_z")
    same_z, plain = stats.scores(values, red, "zscore")

    np.testing.assert_array_equal(z, stats.zscores(values, red.mean, red.std))
    np.testing.assert_array_equal(robust, stats.robust_scores(values, red.p50, red.mad))
    np.testing.assert_array_equal(same_z, z)
    assert plain is same_z  # the z-score method judges outliers by z itself


def test_decode_steps_makes_one_unit_per_step_and_counts_its_events() -> None:
    events = [
        _event("a", 5, 0, 1.0, time=1.0),
        _event("b", 5, 1, 3.0, time=1.0),
        _event("c", 9, 1, 4.0, time=2.0),
    ]

    run, steps, units, counts = decode_steps(events)

    assert steps.tolist() == [5, 9]
    assert counts.tolist() == [2, 1]
    assert units is not None
    assert units.present.tolist() == [[1, 0], [1, 1]]
    assert units.keys["k"].total.tolist() == [[1.0, 0.0], [3.0, 4.0]]
    assert len(run.event_step) == 3
    empty = decode_steps([])
    assert empty.units is None
    assert empty.steps.tolist() == []
