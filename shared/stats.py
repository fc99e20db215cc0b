"""The statistics of the Distributed summary (contract 5.2-5.4): pure numpy functions, no I/O.

Matrices are ``ranks x columns`` float64. ``NaN`` marks "no finite value here" (the rank did not report,
or reported NaN/Infinity, which is counted separately and kept out of every reducer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Matrix = NDArray[np.float64]
Vector = NDArray[np.float64]

PERCENTILES = (5.0, 50.0, 95.0)
#: Iglewicz and Hoaglin's modified z-score: 0.6745 * (x - median) / MAD, flagged at |score| >= 3.5.
MODIFIED_Z = 0.6745
#: When MAD is 0 (more than half the ranks agree exactly) the score falls back to the mean absolute
#: deviation, scaled to be comparable: (x - median) / (1.253314 * MeanAD).
MEAN_AD_SCALE = 1.253314
DEFAULT_OUTLIER_THRESHOLD = 3.5
#: Relative size below which a spread is rounding noise, not a difference between ranks.
ROUNDING = 1e-12


@dataclass(frozen=True)
class Reducers:
    count: NDArray[np.int64]
    mean: Vector
    weighted_mean: Vector
    min: Vector
    max: Vector
    range: Vector
    std: Vector
    p05: Vector
    p50: Vector
    p95: Vector
    #: The median absolute deviation from ``p50`` (the scale of the robust scores), from the same sort.
    mad: Vector


def reducers(values: Matrix, weights: Matrix) -> Reducers:
    """Per column reducers over the finite values of the ranks (contract 5.2), from one sort."""
    ordered = values.copy()
    ordered.sort(axis=0)  # NaN sorts last, so the finite values lead each column
    ranks, cols = values.shape
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # The common case: no NaN, no masks to apply (a sum is NaN with a NaN, or with inf and -inf).
        if ranks and not math.isnan(np.add.reduce(ordered[-1])):
            return _reducers_without_nan(values, weights, ordered)
        finite = ~np.isnan(values)
        count = finite.sum(axis=0)
        x0 = np.where(finite, values, 0.0)
        w0 = np.where(finite, weights, 0.0)
        mean = x0.sum(axis=0) / count
        wsum = w0.sum(axis=0)
        weighted_mean = np.where(wsum > 0, np.einsum("ij,ij->j", w0, x0) / wsum, np.nan)
        centred = np.where(finite, values - mean, 0.0)
        std = np.sqrt(np.einsum("ij,ij->j", centred, centred) / count)
        empty = count == 0
        lo = np.where(empty, np.nan, ordered[0] if ranks else np.nan)
        hi = np.where(empty, np.nan, ordered[np.maximum(count - 1, 0), np.arange(cols)] if ranks else np.nan)
        std[lo == hi] = 0.0  # identical values: exactly 0 (see _reducers_without_nan)
        p05, p50, p95 = _interpolate(ordered, count, PERCENTILES)
        mad = _mad_of_sorted(ordered, count, p50)
        return Reducers(count, mean, weighted_mean, lo, hi, hi - lo, std, p05, p50, p95, mad)


def _reducers_without_nan(values: Matrix, weights: Matrix, ordered: Matrix) -> Reducers:
    """:func:`reducers` when every column has all its ranks (``ordered``, which it overwrites): the same
    arithmetic without the masks; the count as a float divides as the count per column does."""
    ranks, cols = values.shape
    n = float(ranks)
    mean = np.add.reduce(values, axis=0) / n
    wsum = np.add.reduce(weights, axis=0)
    weighted_mean = np.einsum("ij,ij->j", weights, values) / wsum
    if cols and not np.minimum.reduce(wsum) > 0:  # (or NaN)
        weighted_mean[~(wsum > 0)] = np.nan
    centred = values - mean
    std = np.sqrt(np.einsum("ij,ij->j", centred, centred) / n)
    lo, hi = ordered[0].copy(), ordered[-1].copy()
    # The population std of identical values is 0, but their mean as summed and divided may be one ulp off
    # them (0.1 on 8 ranks: 0.09999999999999999), which left 4.441e-16: a column whose values are all equal
    # has std exactly 0.
    std[lo == hi] = 0.0
    p05, p50, p95 = _interpolate_rows(ordered, ranks, PERCENTILES)
    mad = _mad_of_sorted_rows(ordered, ranks, p50, scratch=centred)
    count = np.empty(cols, np.int64)
    count.fill(ranks)
    return Reducers(count, mean, weighted_mean, lo, hi, hi - lo, std, p05, p50, p95, mad)


def percentiles(values: Matrix, count: NDArray[np.int64], qs: tuple[float, ...]) -> list[Vector]:
    """numpy's default ("linear") percentiles per column, ignoring NaN, from one sort."""
    ordered = np.sort(values, axis=0)
    with np.errstate(invalid="ignore", over="ignore"):
        return _interpolate(ordered, count, qs)


def _interpolate(ordered: Matrix, count: NDArray[np.int64], qs: tuple[float, ...]) -> list[Vector]:
    """Percentiles from columns sorted with their NaN last (``count`` finite values each).

    Callers ignore floating point errors: ``inf - inf`` is NaN here as in numpy.
    """
    if not len(ordered):
        return [np.full(ordered.shape[1], np.nan) for _ in qs]
    if (count == len(ordered)).all():  # no NaN: the same rows in every column
        return _interpolate_rows(ordered, len(ordered), qs)
    cols = np.arange(ordered.shape[1])
    last = np.maximum(count - 1, 0)
    result = []
    for q in qs:
        position = last * (q / 100.0)
        below = np.floor(position).astype(np.int64)
        above = np.minimum(below + 1, last)
        fraction = position - below
        low = ordered[below, cols]
        high = ordered[above, cols]
        # numpy's _lerp: exact at the end points and monotone.
        value = np.where(fraction >= 0.5, high - (high - low) * (1 - fraction), low + (high - low) * fraction)
        result.append(np.where(count > 0, value, np.nan))
    return result


def _interpolate_rows(ordered: Matrix, n: int, qs: tuple[float, ...]) -> list[Vector]:
    """:func:`_interpolate` when every column has ``n >= 1`` values: the same arithmetic, on whole rows."""
    last = n - 1
    result = []
    for q in qs:
        position = last * (q / 100.0)
        below = math.floor(position)
        fraction = position - below
        low, high = ordered[below], ordered[min(below + 1, last)]
        if fraction >= 0.5:
            result.append(high - (high - low) * (1 - fraction))
        else:
            result.append(low + (high - low) * fraction)
    return result


#: Beyond this many distinct column counts, the MAD of the sorted columns comes from one more sort.
_MAX_COUNT_GROUPS = 8


def _mad_of_sorted(ordered: Matrix, count: NDArray[np.int64], median: Vector) -> Vector:
    """The median of ``|x - median|`` over each column's finite values, as :func:`column_median` of
    ``|values - median|`` gives it, from ``ordered`` (each column sorted with its ``count`` finite
    values first): by :func:`_mad_of_sorted_rows` for each distinct count."""
    ranks, cols = ordered.shape
    result = np.full(cols, np.nan)
    if not ranks or not cols:
        return result
    groups = np.unique(count)
    if len(groups) > _MAX_COUNT_GROUPS:
        return _interpolate(np.sort(np.abs(ordered - median), axis=0), count, (50.0,))[0]
    for n in groups.tolist():
        if n:
            columns = np.nonzero(count == n)[0]
            result[columns] = _mad_of_sorted_rows(ordered[:n, columns], n, median[columns])
    return result


def _mad_of_sorted_rows(ordered: Matrix, n: int, median: Vector, scratch: Matrix | None = None) -> Vector:
    """The median of ``|x - median|`` per column of ``ordered`` (``n >= 1`` sorted finite values each),
    which it overwrites (and ``scratch``, a matrix of the same shape, when given).

    Along a sorted column ``|x - median|`` falls and then rises (rounding keeps ``x - median`` monotone),
    so its k + 1 smallest values are adjacent, and its k-th smallest (from 0) is the least, over the
    windows of k + 1 adjacent entries, of the larger of the window's two ends. A few passes over the
    matrix instead of a sort; the deviations picked are the ones a sort would pick, so the result is
    the same as :func:`column_median` of ``|values - median|``.
    """
    deviation = np.subtract(ordered, median, out=ordered)
    np.abs(deviation, out=deviation)
    # A median of inf or NaN leaves deviations of inf and NaN (|inf - inf|), not in that order, but
    # then the sort's median is NaN too: its interpolation meets inf - inf or NaN, as this one does.
    last = n - 1
    below = last // 2
    fraction = last * 0.5 - below
    low = _kth_smallest(deviation, below, scratch)
    if fraction >= 0.5:
        high = _kth_smallest(deviation, below + 1, scratch)
        value: Vector = high - (high - low) * (1 - fraction)
        return value
    if np.isfinite(np.maximum(deviation[0], deviation[last])).all():
        return low  # low + (high - low) * 0.0 is low when high (at most the largest, an end) is finite
    high = _kth_smallest(deviation, min(below + 1, last), scratch)
    value = low + (high - low) * fraction
    return value


def _kth_smallest(deviation: Matrix, k: int, scratch: Matrix | None) -> Vector:
    """The k-th smallest (from 0) of each column of ``deviation``, whose columns fall and then rise."""
    n = len(deviation)
    if k == 0:
        smallest: Vector = np.minimum.reduce(deviation, axis=0)
        return smallest
    ends = np.maximum(deviation[: n - k], deviation[k:], out=None if scratch is None else scratch[: n - k])
    least: Vector = np.minimum.reduce(ends, axis=0)
    return least


def zscores(values: Matrix, mean: Vector, std: Vector) -> Matrix:
    """(x - mean) / std per column; 0 where std is 0; NaN where there is no value.

    A std below rounding noise (1e-12 of the mean's magnitude, as when identical values are averaged
    in another order) counts as 0: dividing by it would only magnify rounding.
    """
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        keep = std > ROUNDING * np.abs(mean)
        z: Matrix = values - mean
        np.divide(z, std, out=z)  # NaN where there is no value
    if not np.logical_and.reduce(keep, axis=None):
        np.copyto(z, 0.0, where=~keep)
        if math.isnan(np.add.reduce(values, axis=None)):  # a value is missing (or inf - inf): NaN again
            np.copyto(z, np.nan, where=np.isnan(values))
    return z


def column_median(values: Matrix, count: NDArray[np.int64] | None = None) -> Vector:
    """The median of the finite values of each column (NaN for an empty column), from one sort."""
    if count is None:
        count = (~np.isnan(values)).sum(axis=0)
    return percentiles(values, count, (50.0,))[0]


def scores(values: Matrix, red: Reducers, method: str) -> tuple[Matrix, Matrix]:
    """Each value's z against its column (:func:`zscores`), and the score its outliers are judged by:
    the modified z (:func:`robust_scores`) for ``method`` ``"modified_z"``, else z itself."""
    z = zscores(values, red.mean, red.std)
    return z, robust_scores(values, red.p50, red.mad) if method == "modified_z" else z


def robust_scores(values: Matrix, median: Vector | None = None, mad: Vector | None = None) -> Matrix:
    """Modified z-score per value against its column, NaN where there is no value.

    ``0.6745 * (x - median) / MAD`` (Iglewicz and Hoaglin); when MAD is 0 (more than half the ranks
    agree exactly) it falls back to ``(x - median) / (1.253314 * MeanAD)``, and to 0 when every value
    equals the median. Unlike the plain z-score it has no sqrt(n-1) ceiling: one rank far from seven
    agreeing ranks scores far above the threshold. ``median`` and ``mad`` may be passed when already
    known (the reducers' ``p50`` and ``mad``, from their sort of these values): the MAD then costs no
    sort here.
    """
    if median is None:
        median = column_median(values)
    with np.errstate(all="ignore"):
        if mad is not None and not math.isnan(np.add.reduce(values, axis=None)):  # no value missing
            return _modified_z(values - median, mad, None)
        deviation = values - median
        absolute = np.abs(deviation)
        ranks = len(absolute)
        total = absolute.sum(axis=0)  # NaN in a column with a missing value (or no median)
        if ranks and not math.isnan(total.sum()):  # every column has all its ranks (sums of |x| >= 0)
            if not total.any():  # every value is its median (an all-reduced key): MAD and MeanAD are 0
                return np.zeros_like(deviation)
            absolute.sort(axis=0)
            mad = _interpolate_rows(absolute, ranks, (50.0,))[0]
            return _modified_z(deviation, mad, total / ranks)
        finite = ~np.isnan(values)
        count = finite.sum(axis=0)
        mad = _interpolate(np.sort(absolute, axis=0), count, (50.0,))[0]
        mean_ad = np.where(finite, absolute, 0.0).sum(axis=0) / count
        score = np.where(
            mad > 0,
            MODIFIED_Z * deviation / mad,
            np.where(mean_ad > 0, deviation / (MEAN_AD_SCALE * mean_ad), 0.0),
        )
    return np.where(finite, score, np.nan)


def _modified_z(deviation: Matrix, mad: Vector, mean_ad: Vector | None) -> Matrix:
    """The scores of :func:`robust_scores` for deviations without NaN (which it may overwrite);
    ``mean_ad`` is computed here when None and needed."""
    positive = mad > 0
    if np.logical_and.reduce(positive, axis=None):
        score: Matrix = np.multiply(deviation, MODIFIED_Z, out=deviation)
        return np.divide(score, mad, out=score)
    if mean_ad is None:
        mean_ad = np.abs(deviation).sum(axis=0) / len(deviation)
    fallback = ~positive & (mean_ad > 0)
    score = deviation  # column by column, in place
    if positive.any():
        score[:, positive] = MODIFIED_Z * deviation[:, positive] / mad[positive]
    if fallback.any():
        score[:, fallback] = deviation[:, fallback] / (MEAN_AD_SCALE * mean_ad[fallback])
    np.copyto(score, 0.0, where=~(positive | fallback))  # every value is its median
    return score


def pooled_scale(mad: Vector, block: int) -> Vector:
    """Each column's pooled MAD: the median of the MADs of its ``block`` adjacent columns (with a
    handful of ranks one column's MAD is a noisy estimate; the spread changes slowly from step to step)."""
    scale: Vector = np.repeat(pooled_mad(mad, block), block)[: len(mad)]
    return scale


def pooled_mad(mad: Vector, block: int) -> Vector:
    """The median of the MADs (NaN left out) of each ``block`` adjacent columns; the last may be short."""
    cols = len(mad)
    whole, rest = divmod(cols, block)
    if not math.isfinite(mad.sum()):  # MADs are >= 0: a NaN or inf among them
        n_blocks = whole + (rest > 0)
        padded = np.full(n_blocks * block, np.nan)
        padded[:cols] = mad
        blocks = np.sort(padded.reshape(n_blocks, block), axis=1)  # each block's MADs, NaN last
        with np.errstate(invalid="ignore"):
            return _interpolate(blocks.T, (~np.isnan(blocks)).sum(axis=1), (50.0,))[0]
    pooled = np.empty(whole + (rest > 0))
    if whole:
        blocks = mad[: whole * block].reshape(whole, block)
        middle = (block - 1) // 2
        if block % 2:  # the middle value: low + (high - low) * 0.0 is low, all being finite
            blocks = blocks.copy()
            blocks.partition(middle, axis=1)
            pooled[:whole] = blocks[:, middle]
        else:  # the two middle values in place, as a sort puts them
            blocks = np.partition(blocks, [middle, middle + 1], axis=1)
            pooled[:whole] = _interpolate_rows(blocks.T, block, (50.0,))[0]
    if rest:  # the same interpolation on Python floats (IEEE doubles too)
        tail = sorted(mad[whole * block :].tolist())
        last = rest - 1
        position = last * 0.5
        below = math.floor(position)
        fraction = position - below
        low, high = tail[below], tail[min(below + 1, last)]
        if fraction >= 0.5:
            pooled[whole] = high - (high - low) * (1 - fraction)
        else:
            pooled[whole] = low + (high - low) * fraction
    return pooled


def vector_median(values: NDArray[np.float64] | NDArray[np.int64]) -> float:
    """``float(np.median(values))`` of a vector, without its overhead (it matters at a few ranks).

    The same arithmetic: the middle value, or the mean of the two middle values, of a partition;
    NaN when ``values`` is empty or holds a NaN.
    """
    n = len(values)
    if not n:
        return math.nan
    half = n // 2
    if n <= 32:  # a list sorts a few values faster than a partition
        xs = values.tolist()
        if any(x != x for x in xs):
            return math.nan
        xs.sort()
        if n % 2:
            return 0.0 + float(xs[half])
        return (0.0 + (float(xs[half - 1]) + float(xs[half]))) / 2
    kth = [half - 1, half, n - 1] if n % 2 == 0 else [half, n - 1]
    part = np.partition(values, kth).astype(np.float64, copy=False)
    if math.isnan(part[-1]):
        return math.nan
    if n % 2:
        return 0.0 + float(part[half])
    return (0.0 + (float(part[half - 1]) + float(part[half]))) / 2  # as np.mean sums, from +0.0


def rank_sum_p_rows(matrix: Matrix) -> Vector:
    """Per row, the one-sided p-value that its values are larger than the other rows' (pooled) by
    chance: the Mann-Whitney U test (Wilcoxon rank sum), normal approximation with ties and a
    continuity correction. It uses the values' order only, so heavy tails or bursts of the other rows
    do not make a row look unusual. NaN left out; one ranking of every value serves every row.

    >>> x = np.full((2, 30), np.nan); x[0] = np.arange(10.0, 40.0); x[1] = np.arange(30.0)
    >>> [round(float(p), 6) for p in rank_sum_p_rows(x)]
    [0.000112, 0.999894]
    """
    finite = ~np.isnan(matrix)
    n1 = finite.sum(axis=1).astype(np.float64)
    total = float(n1.sum())
    out: Vector = np.ones(matrix.shape[0])
    if total < 2:
        return out
    values = matrix[finite]
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    average = np.cumsum(counts) - (counts - 1) / 2.0  # each value's average rank among its ties
    ranks = np.zeros(matrix.shape)
    ranks[finite] = average[inverse]
    n2 = total - n1
    u = ranks.sum(axis=1) - n1 * (n1 + 1) / 2.0
    ties = float((counts.astype(np.float64) ** 3 - counts).sum())
    variance = n1 * n2 / 12.0 * ((total + 1) - ties / (total * (total - 1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (u - n1 * n2 / 2.0 - 0.5) / np.sqrt(variance)
    usable = (n1 > 0) & (n2 > 0) & (variance > 0)
    out[usable] = 0.5 * np.array([math.erfc(v / math.sqrt(2.0)) for v in z[usable]])
    return out
