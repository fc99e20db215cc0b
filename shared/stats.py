"""The statistics of the Distributed summary (contract 5.2-5.4): pure numpy functions, no I/O.

Matrices are ``ranks x columns`` float64. ``NaN`` marks "no finite value here" (the rank did not report,
or reported NaN/Infinity, which is counted separately and kept out of every reducer).
"""

from __future__ import annotations

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


def bin_columns(values: Matrix, weights: Matrix, bin_size: int) -> tuple[Matrix, Matrix]:
    """Average each rank's finite values over ``bin_size`` consecutive columns; sum their weights.

    The last bin may be shorter. With ``bin_size == 1`` the inputs come back unchanged.
    """
    if bin_size == 1:
        return values, weights
    ranks, cols = values.shape
    n_bins = -(-cols // bin_size)
    pad = n_bins * bin_size - cols
    finite = ~np.isnan(values)
    x = np.pad(np.where(finite, values, 0.0), ((0, 0), (0, pad))).reshape(ranks, n_bins, bin_size)
    n = np.pad(finite, ((0, 0), (0, pad))).reshape(ranks, n_bins, bin_size).sum(axis=2)
    w = np.pad(np.where(finite, weights, 0.0), ((0, 0), (0, pad))).reshape(ranks, n_bins, bin_size)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, x.sum(axis=2) / n, np.nan)
    return mean, w.sum(axis=2)


def column_any(mask: NDArray[np.bool_], bin_size: int) -> NDArray[np.bool_]:
    """True where a rank has the flag at any column of the bin."""
    return _reduce_bins(mask, bin_size, np.logical_or, False)


def column_all(mask: NDArray[np.bool_], bin_size: int) -> NDArray[np.bool_]:
    """True where a rank has the flag at every column of the bin."""
    return _reduce_bins(mask, bin_size, np.logical_and, True)


def _reduce_bins(mask: NDArray[np.bool_], bin_size: int, op: np.ufunc, fill: bool) -> NDArray[np.bool_]:
    if bin_size == 1:
        return mask
    rows, cols = mask.shape
    n_bins = -(-cols // bin_size)
    padded = np.pad(mask, ((0, 0), (0, n_bins * bin_size - cols)), constant_values=fill)
    result: NDArray[np.bool_] = op.reduce(padded.reshape(rows, n_bins, bin_size), axis=2)
    return result


def reducers(values: Matrix, weights: Matrix) -> Reducers:
    """Per column reducers over the finite values of the ranks (contract 5.2), from one sort."""
    finite = ~np.isnan(values)
    if finite.all():  # the common case: no masks to apply
        count = np.full(values.shape[1], values.shape[0], np.int64)
        x0, w0 = values, weights
    else:
        count = finite.sum(axis=0)
        x0 = np.where(finite, values, 0.0)
        w0 = np.where(finite, weights, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = x0.sum(axis=0) / count
        wsum = w0.sum(axis=0)
        weighted_mean = np.where(wsum > 0, np.einsum("ij,ij->j", w0, x0) / wsum, np.nan)
        centred = x0 - mean if x0 is values else np.where(finite, values - mean, 0.0)
        std = np.sqrt(np.einsum("ij,ij->j", centred, centred) / count)
    ordered = np.sort(values, axis=0)  # NaN sorts last, so the finite values lead each column
    cols = np.arange(values.shape[1])
    empty = count == 0
    lo = np.where(empty, np.nan, ordered[0] if len(ordered) else np.nan)
    hi = np.where(empty, np.nan, ordered[np.maximum(count - 1, 0), cols] if len(ordered) else np.nan)
    p05, p50, p95 = _interpolate(ordered, count, PERCENTILES)
    return Reducers(count, mean, weighted_mean, lo, hi, hi - lo, std, p05, p50, p95)


def percentiles(values: Matrix, count: NDArray[np.int64], qs: tuple[float, ...]) -> list[Vector]:
    """numpy's default ("linear") percentiles per column, ignoring NaN, from one sort."""
    return _interpolate(np.sort(values, axis=0), count, qs)


def _interpolate(ordered: Matrix, count: NDArray[np.int64], qs: tuple[float, ...]) -> list[Vector]:
    """Percentiles from columns sorted with their NaN last (``count`` finite values each)."""
    if not len(ordered):
        return [np.full(ordered.shape[1], np.nan) for _ in qs]
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


def zscores(values: Matrix, mean: Vector, std: Vector) -> Matrix:
    """(x - mean) / std per column; 0 where std is 0; NaN where there is no value.

    A std below rounding noise (1e-12 of the mean's magnitude, as when identical values are averaged
    in another order) counts as 0: dividing by it would only magnify rounding.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(std > ROUNDING * np.abs(mean), (values - mean) / std, 0.0)
    return np.where(np.isnan(values), np.nan, z)


def column_median(values: Matrix, count: NDArray[np.int64] | None = None) -> Vector:
    """The median of the finite values of each column (NaN for an empty column), from one sort."""
    if count is None:
        count = (~np.isnan(values)).sum(axis=0)
    return percentiles(values, count, (50.0,))[0]


def robust_scores(values: Matrix, median: Vector | None = None) -> Matrix:
    """Modified z-score per value against its column, NaN where there is no value.

    ``0.6745 * (x - median) / MAD`` (Iglewicz and Hoaglin); when MAD is 0 (more than half the ranks
    agree exactly) it falls back to ``(x - median) / (1.253314 * MeanAD)``, and to 0 when every value
    equals the median. Unlike the plain z-score it has no sqrt(n-1) ceiling: one rank far from seven
    agreeing ranks scores far above the threshold. ``median`` may be passed when already known (the
    reducers' ``p50``).
    """
    finite = ~np.isnan(values)
    count = finite.sum(axis=0)
    if median is None:
        median = column_median(values, count)
    with np.errstate(all="ignore"):
        deviation = values - median
        absolute = np.abs(deviation)
        mad = column_median(absolute, count)
        mean_ad = np.where(finite, absolute, 0.0).sum(axis=0) / count
        score = np.where(
            mad > 0,
            MODIFIED_Z * deviation / mad,
            np.where(mean_ad > 0, deviation / (MEAN_AD_SCALE * mean_ad), 0.0),
        )
    return np.where(finite, score, np.nan)


def pooled_scores(values: Matrix, median: Vector, block: int) -> Matrix:
    """Like :func:`robust_scores`, but each column's MAD is the median MAD of its ``block`` columns.

    With a handful of ranks the MAD of one column is itself a noisy estimate (8 ranks: a median of 8
    deviations), which turns ordinary values into large scores now and then. The spread between ranks
    changes slowly from step to step, so the median of the MADs of adjacent columns estimates it far
    better. 0 where that pooled MAD is 0.
    """
    cols = values.shape[1]
    n_blocks = -(-cols // block)
    deviation = values - median
    mad = column_median(np.abs(deviation))
    blocks = np.pad(mad, (0, n_blocks * block - cols), constant_values=np.nan).reshape(n_blocks, block)
    pooled = percentiles(blocks.T, (~np.isnan(blocks)).sum(axis=1), (50.0,))[0]
    scale = np.repeat(pooled, block)[:cols]
    with np.errstate(all="ignore"):
        score = np.where(scale > 0, MODIFIED_Z * deviation / scale, 0.0)
    return np.where(np.isnan(values), np.nan, score)


#: Robust scores are clipped here before they are averaged per rank: a few spikes move nothing.
CLIP = 10.0


def rank_offsets(score: Matrix) -> Vector:
    """Each rank's persistent offset: the mean of its robust scores, each clipped to +/-``CLIP``.

    About 0 for a typical rank; a rank beyond the outlier threshold on most of its columns has an
    offset beyond it too, while a few spikes (at most ``CLIP`` each) barely move it. NaN for no values.
    """
    finite = ~np.isnan(score)
    with np.errstate(all="ignore"):
        offsets: Vector = np.where(finite, np.clip(score, -CLIP, CLIP), 0.0).sum(axis=1) / finite.sum(axis=1)
    return offsets


def rank_noise(score: Matrix) -> Vector:
    """How much each rank jumps around compared with a typical rank: about 1 for a typical rank.

    From the robust scores (each value against its column's median and MAD): a rank's spread is the
    mean absolute deviation of its clipped scores from its own offset (so a consistently slower rank is
    not "noisy", and a few spikes do not move it), and ``noise`` is that spread over the median spread
    of all ranks. No sort, so it costs a few passes over the matrix. NaN where a rank has fewer than 3
    values or the typical spread is 0 (a key that is identical on every rank).
    """
    finite = ~np.isnan(score)
    n = finite.sum(axis=1)
    clipped = np.clip(score, -CLIP, CLIP)
    with np.errstate(all="ignore"):
        offset = np.where(finite, clipped, 0.0).sum(axis=1) / n
        spread = np.where(finite, np.abs(clipped - offset[:, None]), 0.0).sum(axis=1) / n
    spread[n < 3] = np.nan
    known = spread[~np.isnan(spread)]
    typical = float(np.median(known)) if len(known) else np.nan
    with np.errstate(all="ignore"):
        return np.where(typical > 0, spread / typical, np.nan)
