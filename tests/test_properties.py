"""Property tests (hypothesis): the reducers against a plain-Python reference, and invariances."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shared import stats

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
            assert math.isnan(red.mean[c]) and math.isnan(red.p50[c])
            continue
        scale = max(abs(x) for x in xs)  # sums of values cancel: relative to the largest magnitude
        mean = math.fsum(xs) / len(xs)
        wsum = math.fsum(w for _, w in pairs)
        assert _close(red.mean[c], mean, scale)
        assert _close(
            red.weighted_mean[c], math.fsum(x * w for x, w in pairs) / wsum if wsum else None, scale
        )
        assert red.min[c] == min(xs) and red.max[c] == max(xs) and red.range[c] == max(xs) - min(xs)
        assert _close(red.std[c], math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs)), scale)
        for q, got in zip((5, 50, 95), (red.p05, red.p50, red.p95), strict=True):
            assert _close(got[c], _percentile(xs, q), scale)


@settings(max_examples=100, deadline=None)
@given(matrices(), st.randoms())
def test_permuting_ranks_changes_no_column_statistic(
    data: tuple[np.ndarray, np.ndarray], rnd: object
) -> None:
    values, weights = data
    order = np.random.default_rng(abs(hash(str(rnd))) % 2**32).permutation(values.shape[0])
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


@settings(max_examples=100, deadline=None)
@given(matrices())
def test_binning_with_bin_size_one_is_no_binning(data: tuple[np.ndarray, np.ndarray]) -> None:
    values, weights = data
    binned, w = stats.bin_columns(values, weights, 1)
    np.testing.assert_array_equal(binned, values)
    np.testing.assert_array_equal(w, weights)
    mask = ~np.isnan(values)
    assert np.array_equal(stats.column_all(mask, 1), mask) and np.array_equal(stats.column_any(mask, 1), mask)


@settings(max_examples=100, deadline=None)
@given(matrices(), st.integers(2, 5))
def test_binning_averages_each_rank_over_its_finite_values(
    data: tuple[np.ndarray, np.ndarray], size: int
) -> None:
    values, weights = data
    binned, w = stats.bin_columns(values, weights, size)
    for r in range(values.shape[0]):
        for b in range(binned.shape[1]):
            xs = values[r, b * size : (b + 1) * size]
            ws = weights[r, b * size : (b + 1) * size]
            ok = ~np.isnan(xs)
            if ok.any():
                assert _close(binned[r, b], math.fsum(xs[ok]) / ok.sum(), float(np.abs(xs[ok]).max()))
            else:
                assert math.isnan(binned[r, b])
            assert _close(w[r, b], math.fsum(ws[ok]), 1.0)
