"""Findings (contract 5.5): the Distributed tab's questions answered in plain language. No I/O.

Each detector looks at numpy matrices (``ranks x columns``) that the summary has already built and
returns finding rows ``{kind, rank, key, step, severity, message}``. The thresholds are chosen so that a
clean run (every rank reporting, independent noise, uneven but unbiased weights) produces no ``warning``
or ``critical`` row at 8 or at 512 ranks, while each fault the tests inject is found; they are fixed and
do not follow the ``outlier_*`` query parameters, so exploring outliers never changes the answers.

Kinds, severities and rules:

- ``stopped_reporting`` (critical): a rank below the world size has not reported the run's last
  ``STOP_GRACE_STEPS + 1`` steps or more (fewer: ``info``, it may only be catching up).
- ``missing_steps`` (warning): a rank is absent at steps between its first and last that others reported.
- ``nonfinite`` (warning): a rank reported NaN or +/-Infinity for a key.
- ``persistent_outlier`` (warning): a rank's offset (``stats.rank_offsets``: the mean of its robust
  scores clipped to +/-10) is beyond ``PERSISTENT_SCORE`` (at least ``MIN_COLUMNS`` columns); the
  message gives the direction and size.
- ``noisy_rank`` (warning): ``noise`` (``stats.rank_noise``) >= ``NOISY_RATIO`` over at least
  ``MIN_NOISE_COLUMNS`` columns.
- ``spike`` (warning): a rank that is neither persistent nor noisy has values whose robust score (below
  ``POOL_BELOW_RANKS`` ranks with the median MAD of ``SPIKE_POOL_COLUMNS`` adjacent columns,
  ``stats.pooled_scores``) is beyond
  ``spike_threshold(cells)``, a bar that grows with the number of values so that chance alone crosses
  it in a clean run less than about once in a hundred summaries (needs ``MIN_SPIKE_RANKS`` ranks and
  ``MIN_SPIKE_COLUMNS`` columns).
- ``weighted_differs`` (info): the weighted mean sits on the same side of the plain mean on at least
  ``WEIGHTED_SAME_SIDE`` of the columns, by a median of ``WEIGHTED_SHIFT`` column standard deviations or
  more; names the rank whose weight pulls it most.
- ``rank_disagreement`` (critical): a key that all other ranks report identically at every step (an
  all-reduced value) differs on some rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shared import stats

Finding = dict[str, Any]

STOP_GRACE_STEPS = 2
MIN_COLUMNS = 3
PERSISTENT_SCORE = stats.DEFAULT_OUTLIER_THRESHOLD
NOISY_RATIO = 2.5
MIN_NOISE_COLUMNS = 20
SPIKE_FALSE_ALARM_RATE = 0.01
MIN_SPIKE_RANKS = 4
MIN_SPIKE_COLUMNS = 10
WEIGHTED_SHIFT = 0.25
WEIGHTED_SAME_SIDE = 0.8
MIN_WEIGHTED_COLUMNS = 10
#: Spikes are scored against the median MAD of this many adjacent columns.
SPIKE_POOL_COLUMNS = 21
#: From this many ranks on, one column's MAD is precise enough (and pooling costs one more sort).
POOL_BELOW_RANKS = 256
#: Values closer than this (relative) are "identical" for an all-reduced key.
AGREEMENT_RTOL = 1e-9


def _finding(
    kind: str, rank: int | None, key: str | None, step: int | None, severity: str, message: str
) -> Finding:
    return {"kind": kind, "rank": rank, "key": key, "step": step, "severity": severity, "message": message}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _list_steps(steps: list[int], limit: int = 5) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def spike_threshold(cells: int, ranks: int, base: float = stats.DEFAULT_OUTLIER_THRESHOLD) -> float:
    """The robust score a single value must exceed to be a ``spike`` among ``cells`` values.

    For independent normal noise the modified z-score is about a standard normal, and
    ``P(|Z| > t) <= exp(-t^2 / 2)``; ``t = sqrt(2 ln(cells / rate))`` keeps the chance that any of
    ``cells`` clean values crosses it below ``rate``. With few ranks the median and MAD are themselves
    noisy and the scores' tails heavier: the bar grows by ``1 + 3.5 / ranks`` (measured on normal
    noise: the 99.99th percentile of |score| is 1.38x the normal one at 8 ranks, 1.04x at 32). Below
    ``MIN_SPIKE_RANKS`` ranks no value can be told apart as a spike: the bar is infinite.
    """
    if ranks < MIN_SPIKE_RANKS:
        return math.inf
    return max(base, math.sqrt(2 * math.log(max(cells, 1) / SPIKE_FALSE_ALARM_RATE))) * (1 + 3.5 / ranks)


@dataclass(frozen=True)
class RolledCoverage:
    """Per rank, what rolled-up blocks (counts per block, no single steps) add to coverage."""

    behind: NDArray[np.int64]  # steps after the rank's last one where it was expected
    missed: NDArray[np.int64]  # steps between its first and last that it missed
    span: NDArray[np.int64]  # steps between its first and last
    first_gap_step: NDArray[np.int64]  # first step of the first block with a miss, -1 for none


def coverage_findings(
    present: NDArray[np.bool_],
    step_world_size: NDArray[np.int64],
    steps: NDArray[np.int64],
    last_seen: NDArray[np.int64],
    first_seen: NDArray[np.int64],
    run_last: int | None,
    rolled: RolledCoverage | None = None,
) -> list[Finding]:
    """``stopped_reporting`` and ``missing_steps`` from who reported at each single step known.

    ``present`` (ranks x ``steps``) covers the steps read one by one; ``first_seen``/``last_seen`` are
    each rank's first and last step in the whole window (-1: never), including rolled-up blocks, whose
    counts come in ``rolled``.
    """
    findings: list[Finding] = []
    if run_last is None:
        return findings
    ranks = np.arange(len(last_seen))
    expected = ranks[:, None] < step_world_size[None, :]  # rank r is expected at step s
    zero = np.zeros(len(ranks), np.int64)
    rolled_behind = zero if rolled is None else rolled.behind
    rolled_missed = zero if rolled is None else rolled.missed
    rolled_span = zero if rolled is None else rolled.span
    rolled_gap = zero - 1 if rolled is None else rolled.first_gap_step
    for r in ranks:
        last = int(last_seen[r])
        if last < 0:
            behind = int(expected[r].sum() + rolled_behind[r])
            if behind:
                findings.append(
                    _finding(
                        "stopped_reporting",
                        int(r),
                        None,
                        None,
                        "critical" if behind > STOP_GRACE_STEPS else "info",
                        f"rank {r} never reported in this window, though the world size included it "
                        f"at {behind} step{'s' if behind != 1 else ''}; the run is at step {run_last}",
                    )
                )
            continue
        behind = int((expected[r] & (steps > last)).sum() + rolled_behind[r])
        if behind:
            critical = behind > STOP_GRACE_STEPS
            findings.append(
                _finding(
                    "stopped_reporting",
                    int(r),
                    None,
                    last,
                    "critical" if critical else "info",
                    f"rank {r} has not reported since step {last}; the run is at step "
                    f"{run_last} ({behind} step{'s' if behind != 1 else ''} behind"
                    + (")" if critical else ", it may only be catching up)"),
                )
            )
        inside = (steps >= first_seen[r]) & (steps <= last)
        gaps = np.nonzero(expected[r] & inside & ~present[r])[0]
        missed = len(gaps) + int(rolled_missed[r])
        if missed:
            span = int((inside & (step_world_size > 0)).sum() + rolled_span[r])
            listed = [int(s) for s in steps[gaps]]
            where = [f"steps {_list_steps(listed)}"] if listed else []
            if rolled_missed[r]:
                where.append(f"{int(rolled_missed[r])} in rolled-up blocks from step {int(rolled_gap[r])}")
            where_text = "; ".join(where)
            first_gap = min(listed[:1] + ([int(rolled_gap[r])] if rolled_missed[r] else []))
            findings.append(
                _finding(
                    "missing_steps",
                    int(r),
                    None,
                    first_gap,
                    "warning",
                    f"rank {r} is intermittently absent: it missed {missed} of the {span} steps "
                    f"between steps {int(first_seen[r])} and {last} that the others reported ({where_text})",
                )
            )
    return findings


def key_findings(
    key: str,
    values: stats.Matrix,
    weights: stats.Matrix,
    red: stats.Reducers,
    score: stats.Matrix,
    noise: stats.Vector,
    nonfinite: NDArray[np.bool_],
    complete: NDArray[np.bool_],
    columns: NDArray[np.int64],
    bin_size: int,
) -> list[Finding]:
    """The findings about one key from its (binned) matrix and the statistics already computed.

    ``red`` is ``stats.reducers(values, weights)``, ``score`` the modified z-score, ``noise`` the per-rank
    noise ratio, ``nonfinite`` where a rank reported NaN/Infinity, ``complete`` where a rank reported
    every step of the column with a finite value (only those cells can be compared exactly), ``columns``
    the first step of each column.

    Most of a clean key's work is showing that there is nothing to report, so each detector first
    looks at what the reducers already know (a column's MAD, extremes and counts) and only reads the
    matrix where a finding is possible; the findings are the same as scoring every value.
    """
    findings: list[Finding] = []
    per = "step" if bin_size == 1 else f"column of {bin_size} steps"
    pers = "steps" if bin_size == 1 else f"columns of {bin_size} steps"
    if nonfinite.any():
        findings += _nonfinite(key, nonfinite, columns, bin_size)

    ranks, n_columns = values.shape
    full = ranks > 0 and (not n_columns or int(red.count.min()) == ranks)  # no value missing
    agreement = _all_reduced_agreement(values, red, complete, full)
    if agreement is not None:
        # An all-reduced key has no spread: robust scores only echo the disagreement found here.
        findings += _disagreement(key, values, red.p50, columns, pers, *agreement)
        return findings + _weighted(key, values, weights, red, pers, full)

    finite = None if full else ~np.isnan(values)  # only when a value is missing
    n_cols = None if finite is None else finite.sum(axis=1)

    def values_of(r: int) -> int:
        return n_columns if n_cols is None else int(n_cols[r])

    special: set[int] = set()
    offsets = stats.rank_offsets(score)
    beyond = np.abs(offsets) >= PERSISTENT_SCORE
    if n_cols is not None:
        beyond &= n_cols >= MIN_COLUMNS
    elif n_columns < MIN_COLUMNS:
        beyond[:] = False
    for r in beyond.nonzero()[0].tolist():
        has = ~np.isnan(values[r]) if finite is None else finite[r]
        row = score[r][has]
        typical = float(offsets[r])
        special.add(r)
        direction = 1.0 if typical > 0 else -1.0
        flagged = int((row * direction >= PERSISTENT_SCORE).sum())
        others = np.delete(values, r, axis=0)
        with np.errstate(all="ignore"):
            others_median = stats.column_median(others)
        mine, theirs = values[r][has], others_median[has]
        ok = np.isfinite(theirs)
        mine, theirs = mine[ok], theirs[ok]
        word = "above" if direction > 0 else "below"
        if len(theirs) and np.all(theirs != 0) and (np.all(theirs > 0) or np.all(theirs < 0)):
            pct = float(np.median(np.abs((mine - theirs) / theirs))) * 100
            size = f"{pct:.0f}% {word}"
        else:
            size = f"{_fmt(float(np.median(np.abs(mine - theirs))) if len(theirs) else 0.0)} {word}"
        findings.append(
            _finding(
                "persistent_outlier",
                r,
                key,
                int(columns[np.argmax(has)]),
                "warning",
                f"rank {r}: {key} is {size} the median of the other ranks "
                f"(an outlier on {flagged} of its {values_of(r)} {pers})",
            )
        )

    for r in (noise >= NOISY_RATIO).nonzero()[0].tolist():
        if values_of(r) < MIN_NOISE_COLUMNS or r in special:
            continue
        special.add(r)
        findings.append(
            _finding(
                "noisy_rank",
                r,
                key,
                None,
                "warning",
                f"rank {r}: {key} jumps around {float(noise[r]):.1f}x as much as a typical rank "
                f"from {per} to {per} (over {values_of(r)} {pers})",
            )
        )

    if full:
        n_counts, typical_ranks = n_columns, float(ranks)
    else:
        counts = red.count[red.count > 0]
        n_counts, typical_ranks = len(counts), stats.vector_median(counts)
    bar = math.inf
    if n_counts >= MIN_SPIKE_COLUMNS:  # else too few columns to know the ranks' usual spread
        bar = spike_threshold(ranks * n_columns if finite is None else int(finite.sum()), int(typical_ranks))
    if bar < math.inf:  # else no value can be a spike
        pooled = typical_ranks < POOL_BELOW_RANKS
        for rank, cols, scores in _pooled_spikes(values, red, bar) if pooled else _spikes(score, bar):
            if rank in special:
                continue
            largest = int(np.argmax(np.abs(scores)))
            worst = int(cols[largest])
            findings.append(
                _finding(
                    "spike",
                    rank,
                    key,
                    int(columns[cols[0]]),
                    "warning",
                    f"rank {rank}: {key} has outlier values at {len(cols)} "
                    f"{per if len(cols) == 1 else pers} ({_list_steps([int(columns[c]) for c in cols])}); "
                    f"the largest is {_fmt(float(values[rank, worst]))} where the median of the ranks is "
                    f"{_fmt(float(red.p50[worst]))} (robust score {float(scores[largest]):.1f})",
                )
            )
    return findings + _weighted(key, values, weights, red, pers, full)


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
                "warning",
                f"rank {r} reported NaN or Infinity for {key} at {len(cols)} {where}"
                f"{'s' if len(cols) != 1 else ''} ({_list_steps([int(columns[c]) for c in cols])}); "
                "those values are left out of the reducers",
            )
        )
    return findings


#: Spikes per rank: the rank, its columns beyond the bar, and its scores there.
Spikes = list[tuple[int, NDArray[np.intp], stats.Vector]]


def _spikes(score: stats.Matrix, bar: float) -> Spikes:
    """Each rank with a score beyond ``bar``: its columns there and their scores."""
    big = np.abs(score) >= bar  # NaN is never beyond it
    rows = []
    for r in big.any(axis=1).nonzero()[0].tolist():
        cols = big[r].nonzero()[0]
        rows.append((r, cols, score[r, cols]))
    return rows


def _pooled_spikes(values: stats.Matrix, red: stats.Reducers, bar: float) -> Spikes:
    """:func:`_spikes` of ``stats.pooled_scores(values, red.p50, SPIKE_POOL_COLUMNS)``, scoring only
    the blocks of columns that can hold a spike.

    A score is ``0.6745 * (x - p50) / scale`` (0 where the pooled MAD ``scale`` is 0), and rounding
    keeps it monotone in ``x - p50``, which is at most the larger of ``max - p50`` and ``p50 - min``:
    where those stay below ``bar`` on a whole block (one ``scale``), no value of the block is a spike.
    """
    block = SPIKE_POOL_COLUMNS
    pooled = stats.pooled_mad(red.mad, block)
    with np.errstate(all="ignore"):
        reach = np.maximum(red.max - red.p50, red.p50 - red.min)  # at least any |x - p50|, rounded
        below = stats.MODIFIED_Z * np.maximum.reduceat(reach, np.arange(0, len(reach), block)) / pooled < bar
        if np.count_nonzero(below) == len(below):  # (NaN is not below: look there)
            return []
        candidates = ((~below).nonzero()[0][:, None] * block + np.arange(block)).ravel()
        candidates = candidates[candidates < len(reach)]
        scale = pooled[candidates // block]
        score = stats.MODIFIED_Z * (values[:, candidates] - red.p50[candidates]) / scale
        score[:, ~(scale > 0)] = 0.0  # as pooled_scores: no pooled MAD, no score
    return [(r, candidates[cols], scores) for r, cols, scores in _spikes(score, bar)]


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
        findings.append(
            _finding(
                "rank_disagreement",
                int(r),
                key,
                int(columns[c]),
                "critical",
                f"rank {r}: {key} is the same on every other rank (an all-reduced value) but rank {r} "
                f"reports something else at {len(cols)} of its "
                f"{values.shape[1] if comparable is None else int(comparable[r].sum())} {pers}, first "
                f"at step {int(columns[c])} ({_fmt(float(values[r, c]))} vs {_fmt(float(median[c]))}): "
                "the ranks may be out of sync",
            )
        )
    return findings


def _weighted(
    key: str, values: stats.Matrix, weights: stats.Matrix, red: stats.Reducers, pers: str, full: bool
) -> list[Finding]:
    usable = red.std > 0
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
