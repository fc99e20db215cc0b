"""The statistics of the Distributed summary (contract 5.2-5.4): pure numpy functions, no I/O.

Matrices are ``ranks x columns`` float64. ``NaN`` marks "no finite value here" (the rank did not report,
or reported NaN/Infinity, which is counted separately and kept out of every reducer).
"""

from __future__ import annotations

import warnings
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
    """Per column reducers over the finite values of the ranks (contract 5.2)."""
    finite = ~np.isnan(values)
    count = finite.sum(axis=0)
    empty = count == 0
    x0 = np.where(finite, values, 0.0)
    w0 = np.where(finite, weights, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = x0.sum(axis=0) / count
        wsum = w0.sum(axis=0)
        weighted_mean = np.where(wsum > 0, (w0 * x0).sum(axis=0) / wsum, np.nan)
        std = np.sqrt((np.where(finite, values - mean, 0.0) ** 2).sum(axis=0) / count)
    lo = np.where(empty, np.nan, np.min(values, axis=0, where=finite, initial=np.inf))
    hi = np.where(empty, np.nan, np.max(values, axis=0, where=finite, initial=-np.inf))
    p05, p50, p95 = percentiles(values, count, PERCENTILES)
    return Reducers(count, mean, weighted_mean, lo, hi, hi - lo, std, p05, p50, p95)


def percentiles(values: Matrix, count: NDArray[np.int64], qs: tuple[float, ...]) -> list[Vector]:
    """numpy's default ("linear") percentiles per column, ignoring NaN, from one sort."""
    ordered = np.sort(values, axis=0)  # NaN sorts last, so the finite values lead each column
    cols = np.arange(values.shape[1])
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
    """(x - mean) / std per column; 0 where std is 0; NaN where there is no value."""
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(std > 0, (values - mean) / std, 0.0)
    return np.where(np.isnan(values), np.nan, z)


def robust_scores(values: Matrix) -> Matrix:
    """Modified z-score per value against its column, NaN where there is no value.

    Unlike the plain z-score it has no sqrt(n-1) ceiling: one rank far from seven agreeing ranks
    scores far above the threshold.
    """
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: their result is NaN anyway
        median = np.nanmedian(values, axis=0) if values.size else np.zeros(values.shape[1])
        deviation = values - median
        mad = np.nanmedian(np.abs(deviation), axis=0) if values.size else median
        mean_ad = np.nanmean(np.abs(deviation), axis=0) if values.size else median
        score = np.where(
            mad > 0,
            MODIFIED_Z * deviation / mad,
            np.where(mean_ad > 0, deviation / (MEAN_AD_SCALE * mean_ad), 0.0),
        )
    return np.where(np.isnan(values), np.nan, score)
