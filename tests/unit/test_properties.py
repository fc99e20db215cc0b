"""Property tests (hypothesis): the reducers against a plain-Python reference, and invariances."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shared import stats

if TYPE_CHECKING:
    from shared.summary.document import Summary

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
maybe_missing = st.one_of(finite, st.just(math.nan))


@st.composite
def matrices(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    ranks = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 8))
    values = draw(arrays(np.float64, (ranks, cols), elements=maybe_missing))
    weights = draw(arrays(np.float64, (ranks, cols), elements=st.floats(0, 1e4)))
    return values, weights


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    position = (len(xs) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (position - low)


def _close(got: float, want: float | None, scale: float) -> bool:
    if want is None:
        return math.isnan(got)
    return abs(got - want) <= 1e-9 * max(abs(want), scale) + 1e-300


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(matrices())
def test_reducers_agree_with_a_plain_python_reference(data: tuple[np.ndarray, np.ndarray]) -> None:
    values, weights = data
    red = stats.reducers(values, weights)
    for c in range(values.shape[1]):
        pairs = [(x, w) for x, w in zip(values[:, c], weights[:, c], strict=True) if not math.isnan(x)]
        xs = [x for x, _ in pairs]
        assert red.count[c] == len(xs)
        if not xs:
            assert math.isnan(red.mean[c])
            assert math.isnan(red.p50[c])
            continue
        scale = max(abs(x) for x in xs)  # sums of values cancel: relative to the largest magnitude
        mean = math.fsum(xs) / len(xs)
        wsum = math.fsum(w for _, w in pairs)
        assert _close(red.mean[c], mean, scale)
        assert _close(
            red.weighted_mean[c], math.fsum(x * w for x, w in pairs) / wsum if wsum else None, scale
        )
        assert red.min[c] == min(xs)
        assert red.max[c] == max(xs)
        assert red.range[c] == max(xs) - min(xs)
        assert _close(red.std[c], math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs)), scale)
        for q, got in zip((5, 50, 95), (red.p05, red.p50, red.p95), strict=True):
            assert _close(got[c], _percentile(xs, q), scale)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(matrices(), st.data())
def test_permuting_ranks_changes_no_column_statistic(
    data: tuple[np.ndarray, np.ndarray], draw: st.DataObject
) -> None:
    values, weights = data
    # The permutation is drawn by Hypothesis, so a failure shrinks and replays.
    order = np.array(draw.draw(st.permutations(range(values.shape[0])), label="order"), dtype=np.intp)
    a = stats.reducers(values, weights)
    b = stats.reducers(values[order], weights[order])
    for name in ("count", "mean", "weighted_mean", "min", "max", "std", "p05", "p50", "p95"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-9)
    # Per-rank statistics follow their rank.
    np.testing.assert_allclose(
        stats.robust_scores(values)[order], stats.robust_scores(values[order]), rtol=1e-12, atol=1e-9
    )
    np.testing.assert_allclose(
        stats.zscores(values, a.mean, a.std)[order],
        stats.zscores(values[order], b.mean, b.std),
        rtol=1e-9,
        atol=1e-9,
    )


def _summary_of(values: np.ndarray, weights: np.ndarray, max_steps: int) -> Summary:
    """The real summary of a run whose rank r logged ``values[r, s]`` (NaN: nothing) at step s."""
    from shared.summary.decoding import DecodedRun
    from shared.summary.document import summarize
    from shared.summary.query import SummaryQuery

    rank, step = np.nonzero(~np.isnan(values))
    run = DecodedRun(
        keys=["k"],
        key_id=np.zeros(len(rank), np.int64),
        step=step.astype(np.int64),
        rank=rank.astype(np.int64),
        value=values[rank, step],
        weight=weights[rank, step],
        event_step=step.astype(np.int64),
        event_rank=rank.astype(np.int64),
        event_world_size=np.full(len(rank), values.shape[0], np.int64),
    )
    return summarize(run, "p", "r", SummaryQuery(max_steps=max_steps))


def _reported(data: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Steps some rank reported (a step nobody reported does not exist in a run)."""
    values, weights = data
    kept = ~np.isnan(values).all(axis=0)
    return values[:, kept], weights[:, kept]


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(matrices())
def test_binning_with_bin_size_one_is_no_binning(data: tuple[np.ndarray, np.ndarray]) -> None:
    values, weights = _reported(data)
    if not values.shape[1]:
        return
    summary = _summary_of(values, weights, max_steps=values.shape[1])
    assert summary["bin_size"] == 1
    assert summary["steps"] == list(range(values.shape[1]))
    heat = np.array(summary["heatmap"]["k"]["values"], dtype=float)  # None (no value) becomes NaN
    assert _same(heat, values)
    red = stats.reducers(values, weights)
    for name in ("mean", "weighted_mean", "p50", "std"):
        got = np.array(summary["reducers"]["k"][name], dtype=float)
        np.testing.assert_allclose(
            got, getattr(red, name), rtol=1e-12, atol=1e-12 * np.nanmax(np.abs(values))
        )


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(matrices(), st.integers(1, 8))
def test_binning_averages_each_rank_over_its_values_and_weights_them_by_their_sum(
    data: tuple[np.ndarray, np.ndarray], max_steps: int
) -> None:
    values, weights = _reported(data)
    n = values.shape[1]
    if not n:
        return
    summary = _summary_of(values, weights, max_steps)
    size = summary["bin_size"]
    assert size == -(-n // min(max_steps, n))
    heat = summary["heatmap"]["k"]["values"]
    for b, first in enumerate(summary["steps"]):
        assert first == b * size
        means, sums, magnitude = [], [], 0.0
        for r in range(values.shape[0]):
            xs, ws = values[r, first : first + size], weights[r, first : first + size]
            ok = ~np.isnan(xs)
            if not ok.any():
                assert heat[r][b] is None
                continue
            mean = math.fsum(xs[ok]) / ok.sum()
            assert _close(heat[r][b], mean, float(np.abs(xs[ok]).max()))
            means.append(mean)
            sums.append(math.fsum(ws[ok]))
            magnitude = max(magnitude, float(np.abs(xs[ok]).max()))
        # A float sum's error follows the size of what it adds, not of its result: values that cancel
        # to 1.7e-18 may come back as 0.0 (found by CI), so the bound is the bin's largest value.
        scale = max(max(abs(m) for m in means), magnitude)
        assert summary["reducers"]["k"]["count"][b] == len(means)
        assert _close(summary["reducers"]["k"]["mean"][b], math.fsum(means) / len(means), scale)
        total = math.fsum(sums)
        weighted = summary["reducers"]["k"]["weighted_mean"][b]
        if total > 0:
            assert _close(weighted, math.fsum(m * w for m, w in zip(means, sums, strict=True)) / total, scale)
        else:
            assert weighted is None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal value for value, NaN where NaN, and the same sign of zero."""
    nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all((a == b) & (np.signbit(a) == np.signbit(b)) | nan))


awkward = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e308, -1e308, math.inf, -math.inf, math.nan])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: arrays(np.float64, (n, 6), elements=st.one_of(finite, awkward))))
def test_the_mad_from_the_sort_is_that_of_a_sort_of_the_deviations(values: np.ndarray) -> None:
    red = stats.reducers(values, np.ones_like(values))
    with np.errstate(all="ignore"):
        assert _same(red.mad, stats.column_median(np.abs(values - red.p50)))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(3, 12), st.integers(3, 30)), elements=finite))
def test_without_nan_the_shortcuts_give_what_the_masked_computation_gives(values: np.ndarray) -> None:
    # A rank that reported nothing sends every function down its masked path; the others' results stay.
    weights = np.ones_like(values)
    gap = np.vstack([values, np.full(values.shape[1], math.nan)])
    a, b = stats.reducers(values, weights), stats.reducers(gap, np.vstack([weights, weights[:1]]))
    for name in ("count", "mean", "weighted_mean", "min", "max", "range", "std", "p05", "p50", "p95", "mad"):
        got, want = getattr(a, name), getattr(b, name)
        assert _same(got.astype(float), want.astype(float)), name
    assert _same(stats.zscores(values, a.mean, a.std), stats.zscores(gap, b.mean, b.std)[:-1])
    robust, robust_gap = stats.robust_scores(values, a.p50), stats.robust_scores(gap, b.p50)
    assert _same(robust, robust_gap[:-1])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 10), st.integers(1, 12)), elements=finite))
def test_robust_scores_with_the_reducers_mad_equal_the_scores_computed_alone(values: np.ndarray) -> None:
    red = stats.reducers(values, np.ones_like(values))
    with np.errstate(all="ignore"):
        deviation = values - red.p50
        mad = stats.column_median(np.abs(deviation))
        mean_ad = np.abs(deviation).mean(axis=0)
        want = np.where(
            mad > 0,
            stats.MODIFIED_Z * deviation / mad,
            np.where(mean_ad > 0, deviation / (stats.MEAN_AD_SCALE * mean_ad), 0.0),
        )
    assert _same(red.mad, mad)
    assert _same(stats.robust_scores(values, red.p50, red.mad), want)
    assert _same(stats.robust_scores(values), want)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.one_of(arrays(np.float64, st.integers(0, 40), elements=st.one_of(finite, awkward)),
                 arrays(np.int64, st.integers(0, 40), elements=st.integers(-5, 5))))  # fmt: skip
def test_vector_median_is_numpys(values: np.ndarray) -> None:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = float(np.median(values)) if len(values) else math.nan
    got = stats.vector_median(values)
    assert _same(np.array([got]), np.array([want]))


def test_a_rank_that_logged_negative_zero_shows_negative_zero() -> None:
    values = np.array([[-0.0, 1.0], [-0.0, -0.0]])
    summary = _summary_of(values, np.ones_like(values), max_steps=2)
    heat = np.array(summary["heatmap"]["k"]["values"], dtype=float)
    assert _same(heat, values)
