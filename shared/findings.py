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

    ``score`` is the modified z-score, ``noise`` the per-rank noise ratio, ``nonfinite`` where a rank
    reported NaN/Infinity, ``complete`` where a rank reported every step of the column with a finite
    value (only those cells can be compared exactly), ``columns`` the first step of each column.
    """
    findings: list[Finding] = []
    per = "step" if bin_size == 1 else f"column of {bin_size} steps"
    pers = "steps" if bin_size == 1 else f"columns of {bin_size} steps"

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

    disagreeing = _disagreement(key, values, red.p50, complete, columns, pers)
    findings += disagreeing
    if disagreeing or _all_reduced(values, red.p50, complete):
        # An all-reduced key has no spread: robust scores only echo the disagreement found above.
        return findings + _weighted(key, values, weights, red, pers)

    finite = ~np.isnan(values)
    n_cols = finite.sum(axis=1)
    special: set[int] = set()
    offsets = stats.rank_offsets(score)
    for r in np.nonzero((n_cols >= MIN_COLUMNS) & (np.abs(np.nan_to_num(offsets)) >= PERSISTENT_SCORE))[0]:
        row = score[r][finite[r]]
        typical = float(offsets[r])
        special.add(int(r))
        direction = 1.0 if typical > 0 else -1.0
        flagged = int((row * direction >= PERSISTENT_SCORE).sum())
        others = np.delete(values, r, axis=0)
        with np.errstate(all="ignore"):
            others_median = stats.column_median(others)
        mine, theirs = values[r][finite[r]], others_median[finite[r]]
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
                int(r),
                key,
                int(columns[np.argmax(finite[r])]),
                "warning",
                f"rank {r}: {key} is {size} the median of the other ranks "
                f"(an outlier on {flagged} of its {int(n_cols[r])} {pers})",
            )
        )

    for r in np.nonzero(noise >= NOISY_RATIO)[0]:
        if int(n_cols[r]) < MIN_NOISE_COLUMNS or int(r) in special:
            continue
        special.add(int(r))
        findings.append(
            _finding(
                "noisy_rank",
                int(r),
                key,
                None,
                "warning",
                f"rank {r}: {key} jumps around {float(noise[r]):.1f}x as much as a typical rank "
                f"from {per} to {per} (over {int(n_cols[r])} {pers})",
            )
        )

    counts = red.count[red.count > 0]
    bar = spike_threshold(int(finite.sum()), int(np.median(counts)) if len(counts) else 0)
    if len(counts) < MIN_SPIKE_COLUMNS:
        bar = math.inf  # too few columns to know the ranks' usual spread
    if len(counts) and np.median(counts) < POOL_BELOW_RANKS:
        score = stats.pooled_scores(values, red.p50, SPIKE_POOL_COLUMNS)
    with np.errstate(invalid="ignore"):
        big = np.abs(np.nan_to_num(score)) >= bar
    for r in np.nonzero(big.any(axis=1))[0]:
        if int(r) in special:
            continue
        cols = np.nonzero(big[r])[0]
        worst = cols[np.argmax(np.abs(score[r, cols]))]
        findings.append(
            _finding(
                "spike",
                int(r),
                key,
                int(columns[cols[0]]),
                "warning",
                f"rank {r}: {key} has outlier values at {len(cols)} "
                f"{per if len(cols) == 1 else pers} ({_list_steps([int(columns[c]) for c in cols])}); "
                f"the largest is {_fmt(float(values[r, worst]))} where the median of the ranks is "
                f"{_fmt(float(red.p50[worst]))} (robust score {float(score[r, worst]):.1f})",
            )
        )
    return findings + _weighted(key, values, weights, red, pers)


def _all_reduced(values: stats.Matrix, median: stats.Vector, complete: NDArray[np.bool_]) -> bool:
    """True when, at every column with at least 3 comparable ranks, all but a few agree exactly."""
    agree, comparable = _agreement(values, median, complete)
    counts = comparable.sum(axis=0)
    used = counts >= 3
    if not used.any():
        return False
    allowed = np.maximum(1, counts // 10)
    return bool(np.all((counts - (agree & comparable).sum(axis=0))[used] <= allowed[used]))


def _agreement(
    values: stats.Matrix, median: stats.Vector, complete: NDArray[np.bool_]
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    comparable = complete & ~np.isnan(values)
    with np.errstate(invalid="ignore"):
        agree = np.abs(values - median) <= AGREEMENT_RTOL * np.abs(median)
    return agree, comparable


def _disagreement(
    key: str,
    values: stats.Matrix,
    median: stats.Vector,
    complete: NDArray[np.bool_],
    columns: NDArray[np.int64],
    pers: str,
) -> list[Finding]:
    if not _all_reduced(values, median, complete):
        return []
    agree, comparable = _agreement(values, median, complete)
    differs = comparable & ~agree
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
                f"reports something else at {len(cols)} of its {int(comparable[r].sum())} {pers}, first "
                f"at step {int(columns[c])} ({_fmt(float(values[r, c]))} vs {_fmt(float(median[c]))}): "
                "the ranks may be out of sync",
            )
        )
    return findings


def _weighted(
    key: str, values: stats.Matrix, weights: stats.Matrix, red: stats.Reducers, pers: str
) -> list[Finding]:
    usable = (red.std > 0) & np.isfinite(red.weighted_mean) & (red.count >= 2)
    n = int(usable.sum())
    if n < MIN_WEIGHTED_COLUMNS:
        return []
    shift = (red.weighted_mean[usable] - red.mean[usable]) / red.std[usable]
    side = 1.0 if np.median(shift) > 0 else -1.0
    same_side = int((shift * side > 0).sum())
    typical = float(np.median(np.abs(shift)))
    if same_side < WEIGHTED_SAME_SIDE * n or typical < WEIGHTED_SHIFT:
        return []
    # The rank that pulls the weighted mean the most: its weight share above 1/n times its deviation.
    finite = ~np.isnan(values[:, usable])
    w = np.where(finite, weights[:, usable], 0.0)
    share = w / w.sum(axis=0) - finite / finite.sum(axis=0)
    pull = np.nansum(share * np.where(finite, values[:, usable] - red.mean[usable], 0.0), axis=1) * side
    rank = int(np.argmax(pull))
    weight_share = float(np.median(w[rank] / w.sum(axis=0))) * 100
    relative = np.abs(red.weighted_mean[usable] - red.mean[usable])
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
