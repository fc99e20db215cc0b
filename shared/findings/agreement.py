"""Agreement: values that must be finite, or the same on every rank, and a weighted mean that leans
one way. No I/O.

- ``nonfinite`` (critical): a rank reported NaN or +/-Infinity for a key.
- ``rank_disagreement`` (critical): a key that all other ranks report identically at every step (an
  all-reduced value) differs on some rank.
  All-reduced: at every column with at least 3 comparable ranks, all but a few (at most one in 10)
  agree with the median within ``AGREEMENT_RTOL`` (relative). Such a key has no spread, so
  ``key_findings`` judges it by this rule alone (its deviations would only echo the disagreement).
- A *constant* column: every rank's value is the same, up to ``AGREEMENT_RTOL`` (relative) of the
  largest; its standard deviation and weighted mean then differ from 0 and the mean only by
  floating-point rounding (``train/lr`` logged by 512 ranks: a std of 4e-18). A key whose columns are all
  constant is equal on every rank and never gives a finding (``key_findings``); no rule weighs a
  constant column.
- ``weighted_differs`` (info): the weighted mean sits on the same side of the plain mean on at least
  ``WEIGHTED_SAME_SIDE`` of the columns, by a median of ``WEIGHTED_SHIFT`` column standard deviations or
  more; names the rank whose weight pulls it most.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from shared import stats
from shared.findings.common import Finding, _finding, _fmt, _list_steps, _share

#: Values closer than this (relative) are "identical" for an all-reduced key.
AGREEMENT_RTOL = 1e-9
WEIGHTED_SHIFT = 0.25
WEIGHTED_SAME_SIDE = 0.8
MIN_WEIGHTED_COLUMNS = 10


def _nonfinite(
    key: str, nonfinite: NDArray[np.bool_], columns: NDArray[np.int64], bin_size: int
) -> list[Finding]:
    findings = []
    for r in np.nonzero(nonfinite.any(axis=1))[0]:
        cols = np.nonzero(nonfinite[r])[0]
        first = int(columns[cols[0]])
        where = "step" if bin_size == 1 else "step column"
        findings.append(
            _finding(
                "nonfinite",
                int(r),
                key,
                first,
                "critical",
                f"rank {r} reported NaN or Infinity for {key} at {len(cols)} {where}"
                f"{'s' if len(cols) != 1 else ''} ({_list_steps([int(columns[c]) for c in cols])}); "
                "those values are left out of the reducers",
            )
        )
    return findings


def _all_reduced_agreement(
    values: stats.Matrix, red: stats.Reducers, complete: NDArray[np.bool_], full: bool
) -> tuple[NDArray[np.bool_], NDArray[np.bool_] | None] | None:
    """``(agree, comparable)`` when the key is all-reduced, else None; ``comparable`` is None when
    every cell is comparable.

    All-reduced: at every column with at least 3 comparable ranks, all but a few (at most
    ``max(1, n // 10)`` of n) agree with the median. In a column where every rank is comparable that
    leaves more than half of the deviations from the median within the tolerance, and so the MAD
    (the reducers' ``mad``, from the same deviations): a column whose MAD is beyond it rules the key
    out without looking at the matrix. The first column is looked at alone first.
    """
    ranks, n_columns = values.shape
    if not n_columns:
        return None
    if (
        ranks >= 3
        and int(red.count[0]) == ranks
        and float(red.mad[0]) > AGREEMENT_RTOL * abs(float(red.p50[0]))
        and complete[:, 0].all()
    ):
        return None
    everywhere = full and bool(complete.all())  # every rank comparable in every column
    tolerance = AGREEMENT_RTOL * np.abs(red.p50)
    beyond = red.mad > tolerance  # NaN is not
    if ranks >= 3 and beyond.any():
        whole = complete.all(axis=0) & (red.count == ranks)  # every rank comparable in the column
        if everywhere or np.any(beyond & whole):
            return None
    if not everywhere:
        agree, comparable = _agreement(values, red.p50, complete)
        return (agree, comparable) if _agreeing_columns(agree, comparable) else None
    if ranks < 3:  # no column has 3 comparable ranks
        return None
    with np.errstate(invalid="ignore"):
        distance = values - red.p50
        agree = np.abs(distance, out=distance) <= tolerance
    disagreeing = ranks - np.add.reduce(agree, axis=0)
    return (agree, None) if np.logical_and.reduce(disagreeing <= max(1, ranks // 10)) else None


def _agreeing_columns(agree: NDArray[np.bool_], comparable: NDArray[np.bool_]) -> bool:
    """Whether, at every column with at least 3 comparable ranks (and there is one), all but a few
    agree."""
    counts = comparable.sum(axis=0)
    used = counts >= 3
    if not used.any():
        return False
    allowed = np.maximum(1, counts // 10)
    return bool(np.all((counts - (agree & comparable).sum(axis=0))[used] <= allowed[used]))


def _agreement(
    values: stats.Matrix, median: stats.Vector, complete: NDArray[np.bool_]
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    comparable = np.isnan(values)
    np.logical_not(comparable, out=comparable)
    comparable &= complete
    with np.errstate(invalid="ignore"):
        distance = values - median
        agree = np.abs(distance, out=distance) <= AGREEMENT_RTOL * np.abs(median)
    return agree, comparable


def _disagreement(
    key: str,
    values: stats.Matrix,
    median: stats.Vector,
    columns: NDArray[np.int64],
    pers: str,
    agree: NDArray[np.bool_],
    comparable: NDArray[np.bool_] | None,
) -> list[Finding]:
    differs = ~agree if comparable is None else comparable & ~agree
    findings = []
    for r in np.nonzero(differs.any(axis=1))[0]:
        cols = np.nonzero(differs[r])[0]
        c = cols[0]
        compared = values.shape[1] if comparable is None else int(comparable[r].sum())
        findings.append(
            _finding(
                "rank_disagreement",
                int(r),
                key,
                int(columns[c]),
                "critical",
                f"rank {r}: {key} is the same on every other rank (an all-reduced value) but rank {r} "
                f"reports something else {_share(len(cols), compared, pers)}, first at step "
                f"{int(columns[c])} ({_fmt(float(values[r, c]))} vs {_fmt(float(median[c]))}): "
                "the ranks may be out of sync",
            )
        )
    return findings


def constant_columns(red: stats.Reducers) -> NDArray[np.bool_]:
    """The columns whose values are the same on every rank that reported one, up to ``AGREEMENT_RTOL``
    of the largest in size (floating-point rounding); False where no rank did."""
    with np.errstate(invalid="ignore"):
        return red.range <= AGREEMENT_RTOL * np.maximum(np.abs(red.min), np.abs(red.max))  # NaN: False


def _weighted(
    key: str, values: stats.Matrix, weights: stats.Matrix, red: stats.Reducers, pers: str, full: bool
) -> list[Finding]:
    usable = red.std > 0
    usable &= ~constant_columns(red)  # their std and weighted mean are rounding, not spread
    usable &= np.isfinite(red.weighted_mean)
    if not (full and values.shape[0] >= 2):  # else every column has at least 2 values
        usable &= red.count >= 2
    n = np.count_nonzero(usable)
    if n < MIN_WEIGHTED_COLUMNS:
        return []
    everywhere = n == len(usable)
    weighted_mean = red.weighted_mean if everywhere else red.weighted_mean[usable]
    mean = red.mean if everywhere else red.mean[usable]
    shift = (weighted_mean - mean) / (red.std if everywhere else red.std[usable])
    above, below = np.count_nonzero(shift > 0), np.count_nonzero(shift < 0)
    if max(above, below) < WEIGHTED_SAME_SIDE * n:  # too few on either side, whichever the median's
        return []
    side = 1.0 if stats.vector_median(shift) > 0 else -1.0
    same_side = above if side > 0 else below
    if same_side < WEIGHTED_SAME_SIDE * n:
        return []
    typical = stats.vector_median(np.abs(shift))
    if typical < WEIGHTED_SHIFT:
        return []
    # The rank that pulls the weighted mean the most: its weight share above 1/n times its deviation.
    finite = ~np.isnan(values[:, usable])
    w = np.where(finite, weights[:, usable], 0.0)
    share = w / w.sum(axis=0) - finite / finite.sum(axis=0)
    pull = np.nansum(share * np.where(finite, values[:, usable] - red.mean[usable], 0.0), axis=1) * side
    rank = int(np.argmax(pull))
    weight_share = float(np.median(w[rank] / w.sum(axis=0))) * 100
    relative = np.abs(weighted_mean - mean)
    return [
        _finding(
            "weighted_differs",
            rank,
            key,
            None,
            "info",
            f"{key}: the weighted mean is {'above' if side > 0 else 'below'} the plain mean on "
            f"{same_side} of {n} {pers}, by {_fmt(float(np.median(relative)))} "
            f"({typical:.2f} standard deviations of the ranks) in the median; rank {rank} pulls it most, "
            f"carrying {weight_share:.0f}% of the weight",
        )
    ]
