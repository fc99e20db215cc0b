"""Findings (contract 5.5): the Distributed tab's questions answered in plain language. No I/O.

A careful SRE's rules: a rank is flagged for what sets it apart from its peers, with evidence sized to
the claim; noise that every rank shows is never a warning. Each rule looks at the (binned) ``ranks x
columns`` matrix of one key and returns rows ``{kind, rank, key, step, severity, message}``; two rules
then look across keys and ranks. The thresholds are fixed (they do not follow the ``outlier_*`` query
parameters, so exploring outliers never changes the answers).

Severity: ``critical``, the job is broken (a rank stopped, NaN or Infinity, ranks out of sync);
``warning``, a rank differs persistently or by a large margin; ``info``, worth a look but likely benign.

Peers. Each value is compared with the median of the ranks at the same column (with 2 ranks, with the
other rank); for a rank's persistent offset, from 4 to ``LEAVE_ONE_OUT_RANKS`` ranks, with the median of
the *other* ranks (in a small world a rank pulls the median of all towards itself). For a key whose
values are all > 0 (times, losses, token counts) the comparison is a ratio (a log difference), so sizes
read as "30% above" or "8x" whatever the key's level; for other keys it is a difference. A rank's
*offset* is the median of its deviations over its columns; its *spread* is the mean distance of its
deviations (in units of each column's spread across ranks) from its own median, its largest
``SPREAD_TRIM`` left out. Both are robust: a
few spikes move neither. The *typical* spread is the median spread of the ranks.

- ``stopped_reporting`` (critical): a rank below the world size has not reported the run's last
  ``STOP_GRACE_STEPS + 1`` steps or more (fewer: ``info``, it may only be catching up).
- ``missing_steps``: a rank is absent at steps between its first and last that others reported;
  ``warning`` when it missed ``MIN_MISSING`` steps or more and the other ranks' rate (their misses per
  rank, plus one) makes that many less likely than ``MISSING_P`` (Poisson), else ``info`` (a lost event
  now and then is every rank's lot).
- ``nonfinite`` (critical): a rank reported NaN or +/-Infinity for a key.
- ``rank_disagreement`` (critical): a key that all other ranks report identically at every step (an
  all-reduced value) differs on some rank.
- ``persistent_outlier``: a rank's offset is (1) beyond ``PERSISTENT_SE`` standard errors of a median
  (``MEDIAN_SE`` x typical spread / ``TRIMMED_NORMAL`` / sqrt(columns)), (2) from 3 ranks on, beyond
  ``PERSISTENT_PEERS`` x the spread of the ranks' own offsets (1.4826 x their MAD), (3) on one side on at
  least ``PERSISTENT_HELD`` of its columns, and (4) for a positive key, at least ``PERSISTENT_RELATIVE``
  of its peers' level. ``warning`` over ``SUSTAINED_COLUMNS`` columns or more, or when the rank is at
  least ``SPIKE_FOLD`` x (or 1/``SPIKE_FOLD``) its peers; ``info`` over ``MIN_COLUMNS`` to
  ``SUSTAINED_COLUMNS``. With 2 ranks the higher one is named and the message says that 2 ranks show
  a difference, not which one is wrong.
- ``noisy_rank`` (warning, from ``MIN_NOISE_RANKS`` ranks): a rank not persistently apart whose spread
  is ``NOISY_RATIO`` x the typical spread or more, over ``MIN_NOISE_COLUMNS`` columns or more.
- ``spike``: a value of a rank (neither persistent nor noisy) whose deviation from its own offset is
  beyond ``spike_threshold`` robust units of the column's spread (1.4826 x the median MAD of
  ``SPIKE_POOL_COLUMNS`` adjacent columns: chance alone crosses it in about one clean summary in a
  hundred on normal noise) and, for a positive key, at least ``SPIKE_FOLD`` x (or 1/``SPIKE_FOLD``)
  its usual ratio to its peers: an 8x loss is a spike, a 15% blip of one step time is not. Then the
  peers: when more than ``SHARED_SPIKE_RANKS`` ranks or ``SHARED_SPIKE_SHARE`` of them have such values,
  the rate is shared: one ``info`` row for the key. Else a rank's spike is a ``warning`` when its
  largest deviation is ``SPIKE_SEPARATION`` x (in log ratio, or robust units) the largest of the other
  ranks (from 8 ranks the second largest, so that two faulty ranks do not hide each other;
  ``SPIKE_SEPARATION_HEAVY`` x on a heavy-tailed key, one whose robust scores cross the bar on more
  ranks than the shared rate allows, whatever their size), or when it
  has 3 or more such values and the other ranks' rate makes that many less likely than
  ``SPIKE_COUNT_P`` (Poisson); otherwise ``info``. On a time key (``TIME_KEY``) a brief spike is a
  stall, which costs a moment: only the count makes it a ``warning``, and only when the stalls are also
  ``STALL_SHARE`` of the rank's columns or more (a process descheduled a few times is not a fault).
  With 2 ranks spikes are ``info``: nothing tells which rank is wrong.
- ``weighted_differs`` (info): the weighted mean sits on the same side of the plain mean on at least
  ``WEIGHTED_SAME_SIDE`` of the columns, by a median of ``WEIGHTED_SHIFT`` column standard deviations or
  more; names the rank whose weight pulls it most.
- ``straggler`` (warning): a rank with a ``warning`` ``persistent_outlier`` *above* its peers on one
  time key (its name matches ``TIME_KEY``: data loading, its own compute) and *below* them on another
  beyond chance (rules 1-3, any size: a time that includes waiting at the collectives is shorter for
  the rank the others wait for): one row replaces theirs, and says about how much time a step the job
  loses to it.
- ``node_outlier``: when at least half of a node's ranks (2 or more; ``local_rank`` gives the layout)
  share a finding of the same kind and key, one row names the node (``rank`` is its first rank) and
  replaces theirs; severity is the most severe of them.

A healthy job (independent or heavy-tailed noise, rare brief stalls on random ranks, stalls of every
rank at once, warm-up, uneven noise levels up to 1.5x, uneven but unbiased weights) raises no
``warning`` or ``critical`` row: ``benchmarks/findings_quality.py`` measures this and each fault.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shared import stats

Finding = dict[str, Any]

STOP_GRACE_STEPS = 2
MIN_MISSING = 2
MISSING_P = 1e-4
#: Up to this many ranks a rank is compared with the median of the others (a loop over the ranks).
LEAVE_ONE_OUT_RANKS = 16
MIN_COLUMNS = 3
SUSTAINED_COLUMNS = 20
PERSISTENT_SE = 5.0
PERSISTENT_PEERS = 4.0
PERSISTENT_HELD = 0.65
PERSISTENT_RELATIVE = 0.05
NOISY_RATIO = 2.0
MIN_NOISE_RANKS = 4
MIN_NOISE_COLUMNS = 30
SPIKE_FALSE_ALARM_RATE = 0.01
MIN_SPIKE_COLUMNS = 10
SPIKE_FOLD = 2.0
SPIKE_SEPARATION = 2.5
SPIKE_SEPARATION_HEAVY = 4.0
SHARED_SPIKE_RANKS = 2
SHARED_SPIKE_SHARE = 0.1
SPIKE_COUNT_P = 1e-4
STALL_SHARE = 0.1
WEIGHTED_SHIFT = 0.25
WEIGHTED_SAME_SIDE = 0.8
MIN_WEIGHTED_COLUMNS = 10
#: Spikes are scored against the median MAD of this many adjacent columns.
SPIKE_POOL_COLUMNS = 21
#: A rank's spread leaves out its largest distances, this share of them (spikes are not noise).
SPREAD_TRIM = 0.1
#: ... which is 0.657 standard deviations for normal noise.
TRIMMED_NORMAL = 0.657
#: 1.4826 x MAD estimates a normal standard deviation; 1.2533 sigma / sqrt(n) is a median's standard error.
NORMAL_MAD = 1.4826
MEDIAN_SE = 1.2533
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

    For independent normal noise a robust score is about a standard normal, and ``P(|Z| > t) <=
    exp(-t^2 / 2)``; ``t = sqrt(2 ln(cells / rate))`` keeps the chance that any of ``cells`` clean values
    crosses it below ``rate``. With few ranks the medians are themselves noisy and the scores' tails
    heavier: the bar grows by ``1 + 3.5 / ranks`` (measured on normal noise: the 99.99th percentile of
    |score| is 1.38x the normal one at 8 ranks, 1.04x at 32).
    """
    return max(base, math.sqrt(2 * math.log(max(cells, 1) / SPIKE_FALSE_ALARM_RATE))) * (
        1 + 3.5 / max(ranks, 1)
    )


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
    absent: list[tuple[int, int, int, NDArray[np.intp]]] = []
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
            absent.append((int(r), missed, span, gaps))
    total = sum(a[1] for a in absent)
    for rank, missed, span, gaps in absent:
        # A rank's gaps against the other ranks' rate (one lost event now and then is every rank's lot).
        rate = (total - missed + 1) / max(len(ranks) - 1, 1)
        warn = missed >= MIN_MISSING and _poisson_tail(missed, rate) < MISSING_P
        listed = [int(s) for s in steps[gaps]]
        where = [f"steps {_list_steps(listed)}"] if listed else []
        if rolled_missed[rank]:
            where.append(f"{int(rolled_missed[rank])} in rolled-up blocks from step {int(rolled_gap[rank])}")
        where_text = "; ".join(where)
        first_gap = min(listed[:1] + ([int(rolled_gap[rank])] if rolled_missed[rank] else []))
        findings.append(
            _finding(
                "missing_steps",
                rank,
                None,
                first_gap,
                "warning" if warn else "info",
                f"rank {rank} is intermittently absent: it missed {missed} of the {span} steps "
                f"between steps {int(first_seen[rank])} and {int(last_seen[rank])} that the others reported "
                f"({where_text})" + ("" if warn else "; the other ranks miss steps about as often"),
            )
        )
    return findings


@dataclass(frozen=True)
class Offset:
    """A rank persistently apart from its peers on one key (what the cross-key rules combine)."""

    direction: int  # +1 above its peers, -1 below
    size: str  # "30% above", "4.1x", "0.12 above"
    held: int  # columns on that side
    columns: int  # columns compared
    excess: float  # median of (its value - its peers' median), in the key's units
    severity: str


@dataclass
class KeyResult:
    """The findings about one key, and what the summary and the cross-key rules need of them."""

    findings: list[Finding]
    noise: stats.Vector  # per rank: its own spread over the typical rank's (rank_stats' ``noise``)
    offsets: dict[int, Offset] = field(default_factory=dict)
    relative: bool = False
    #: ranks x columns: the cells that back a ``warning`` or ``critical`` finding (the tab's alarm rows).
    alarm: NDArray[np.bool_] | None = None
    #: ranks below their peers beyond chance, whatever the size (a straggler's shorter wait).
    below: dict[int, Offset] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerView:
    """Each value of a key against the median of the rank's peers at the same column.

    ``relative``: every value is > 0, so deviations are log ratios (a rank 30% above its peers is
    ``log(1.3)`` whatever the key's level; an 8x loss is ``log(8)``); else plain differences. Noise and
    spikes are measured in units of each column's spread across ranks (``scale``), so that a key whose
    spread changes over the run (a loss that decays, a warm-up) is judged at each column by its own.
    """

    relative: bool
    deviation: stats.Matrix  # ranks x columns; NaN where the rank has no value
    reference: stats.Matrix  # the peers' median in the key's units (1 x columns, or ranks x columns)
    offset: stats.Vector  # per rank: its persistent shift from the others (see peer_view), for sizes
    z_offset: stats.Vector  # the same in units of the columns' spread
    own_offset: stats.Vector  # per rank: the median of its deviations (where its spikes start from)
    residual: stats.Matrix  # (deviation - own_offset) / scale: a rank's moves about its own place
    spread: stats.Vector  # per rank: the trimmed mean of |residual|
    typical: float  # the median spread of the ranks
    held: NDArray[np.int64]  # per rank: columns on the side of its offset
    n: NDArray[np.int64]  # per rank: columns with a value
    scale: stats.Vector  # per column: 1.4826 x the pooled MAD of the deviations across ranks


def _median(matrix: stats.Matrix, axis: int, nan: bool) -> stats.Vector:
    if not nan:
        out: stats.Vector = np.median(matrix, axis=axis)
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN row or column: NaN, as wanted
        out = np.nanmedian(matrix, axis=axis)
    return out


def _trimmed_spread(distance: stats.Matrix) -> stats.Vector:
    """Per rank, the mean of its distances after its largest ``SPREAD_TRIM`` are left out (a few
    spikes move it not at all); unlike a MAD it stays above 0 when most values are tied (token counts)."""
    missing = np.isnan(distance)
    n = distance.shape[1] - missing.sum(axis=1)
    ordered = np.sort(np.where(missing, np.inf, distance), axis=1)
    keep = np.maximum(1, np.ceil((1 - SPREAD_TRIM) * n)).astype(np.int64)
    ordered[np.arange(ordered.shape[1])[None, :] >= keep[:, None]] = 0.0
    with np.errstate(all="ignore"):
        spread: stats.Vector = np.where(n > 0, ordered.sum(axis=1) / keep, np.nan)
    return spread


def peer_view(values: stats.Matrix, p50: stats.Vector) -> PeerView | None:
    """The :class:`PeerView` of a key's matrix (``p50``: its columns' medians); None below 2 ranks."""
    ranks, cols = values.shape
    if ranks < 2 or not cols:
        return None
    nan = bool(np.isnan(values).any())
    n = (~np.isnan(values)).sum(axis=1) if nan else np.full(ranks, cols, np.int64)
    if not n.any():
        return None
    with np.errstate(all="ignore"):
        relative = bool(np.nanmin(values) > 0)
        x = np.log(values) if relative else values
        # Each rank against the median of the ranks; with 2, against the other (a median sits between).
        reference = x[::-1].copy() if ranks == 2 else (np.log(p50) if relative else p50)[None, :]
        deviation = x - reference
        own_offset = _median(deviation, 1, nan)
        centre = _median(deviation, 0, nan)
        spread_from_centre = np.abs(deviation - centre)
        column_mad = _median(spread_from_centre, 0, nan)
        scale = NORMAL_MAD * stats.pooled_scale(column_mad, SPIKE_POOL_COLUMNS)
        if not np.all(scale > 0):  # most ranks equal (integer counts): the mean absolute deviation
            known = spread_from_centre[~np.isnan(spread_from_centre)]
            fallback = stats.MEAN_AD_SCALE * float(known.mean()) if len(known) else 0.0
            scale = np.where(scale > 0, scale, fallback if fallback > 0 else np.inf)
        # A rank's own noise: its deviations about its own median, each in its column's units (not
        # deviation / scale about its median: a rank far from the others would carry the columns'
        # scale noise).
        residual = (deviation - own_offset[:, None]) / scale
        spread = _trimmed_spread(np.abs(residual))
        offset, z_offset, apart = own_offset, _median(deviation / scale, 1, nan), deviation
        if 4 <= ranks <= LEAVE_ONE_OUT_RANKS:  # in a small world a rank pulls the median towards it
            others = np.empty_like(x)
            for r in range(ranks):
                others[r] = _median(np.delete(x, r, axis=0), 0, nan)
            apart = x - others
            offset, z_offset = _median(apart, 1, nan), _median(apart / scale, 1, nan)
        held = (apart * np.sign(offset)[:, None] > 0).sum(axis=1)
    usable = spread[(n >= MIN_COLUMNS) & ~np.isnan(spread)]
    typical = stats.vector_median(usable) if len(usable) else math.nan
    return PeerView(
        relative,
        deviation,
        np.exp(reference) if relative else reference,
        offset,
        z_offset,
        own_offset,
        residual,
        spread,
        typical,
        held.astype(np.int64),
        n.astype(np.int64),
        scale,
    )


def key_findings(
    key: str,
    values: stats.Matrix,
    weights: stats.Matrix,
    red: stats.Reducers,
    nonfinite: NDArray[np.bool_],
    complete: NDArray[np.bool_],
    columns: NDArray[np.int64],
    bin_size: int,
) -> KeyResult:
    """The findings about one key from its (binned) matrix and its reducers.

    ``nonfinite`` is where a rank reported NaN/Infinity, ``complete`` where a rank reported every step
    of the column with a finite value (only those cells can be compared exactly), ``columns`` the first
    step of each column.
    """
    findings: list[Finding] = []
    pers = "steps" if bin_size == 1 else f"columns of {bin_size} steps"
    if nonfinite.any():
        findings += _nonfinite(key, nonfinite, columns, bin_size)
    ranks, n_columns = values.shape
    no_noise = np.full(ranks, np.nan)
    full = ranks > 0 and (not n_columns or int(red.count.min()) == ranks)  # no value missing
    agreement = _all_reduced_agreement(values, red, complete, full)
    if agreement is not None:
        # An all-reduced key has no spread: deviations only echo the disagreement found here.
        findings += _disagreement(key, values, red.p50, columns, pers, *agreement)
        return KeyResult(findings + _weighted(key, values, weights, red, pers, full), no_noise)
    view = peer_view(values, red.p50)
    if view is None:
        return KeyResult(findings + _weighted(key, values, weights, red, pers, full), no_noise)
    offsets, below, persistent = _persistent(key, view, values, columns, pers)
    findings += persistent
    noise = view.spread / view.typical if view.typical > 0 else no_noise
    if ranks >= MIN_NOISE_RANKS and view.typical > 0:
        findings += _noisy(key, view, noise, set(offsets), pers)
    quiet = [r for r in range(ranks) if r not in offsets and not (noise[r] >= NOISY_RATIO)]
    spikes, spike_cells = _spikes(key, view, values, columns, bin_size, quiet)
    findings += spikes
    findings += _weighted(key, values, weights, red, pers, full)
    alarm = np.zeros(values.shape, bool)
    for f in findings:
        if f["severity"] != "info" and f["rank"] is not None:
            cells = spike_cells.get(f["rank"]) if f["kind"] == "spike" else None
            alarm[f["rank"], slice(None) if cells is None else cells] = True
    return KeyResult(findings, noise, offsets, view.relative, alarm, below)


def _percent(view: PeerView, values: stats.Matrix, r: int) -> tuple[str, float]:
    """How far rank ``r`` sits from its peers, in words, and the excess in the key's units."""
    with np.errstate(all="ignore"):
        gap = _median_of_row(values[r] - np.broadcast_to(view.reference, values.shape)[r])
    offset = float(view.offset[r])
    word = "above" if offset > 0 else "below"
    if view.relative:
        ratio = math.exp(offset)
        if ratio >= 2:
            return f"{ratio:.3g}x", gap
        if ratio <= 0.5:
            return f"{(1 - ratio) * 100:.0f}% below", gap
        return f"{abs(ratio - 1) * 100:.0f}% {word}", gap
    return f"{_fmt(abs(gap))} {word}", gap


def _median_of_row(row: stats.Vector) -> float:
    row = row[~np.isnan(row)]
    return stats.vector_median(row) if len(row) else math.nan


def _persistent(
    key: str, view: PeerView, values: stats.Matrix, columns: NDArray[np.int64], pers: str
) -> tuple[dict[int, Offset], dict[int, Offset], list[Finding]]:
    """``persistent_outlier``: a rank whose typical deviation from its peers (the median over its
    columns) is beyond chance, beyond the other ranks' own offsets, on one side on most columns, and,
    for a key of positive values, at least ``PERSISTENT_RELATIVE`` of its peers' level."""
    ranks = len(view.offset)
    n = view.n
    offset, z_offset = view.offset, view.z_offset
    with np.errstate(all="ignore"):
        standard_error = MEDIAN_SE * (view.typical / TRIMMED_NORMAL) / np.sqrt(n)
        bar = PERSISTENT_SE * standard_error
        if ranks >= 3:
            peers = z_offset[(n >= MIN_COLUMNS) & ~np.isnan(z_offset)]
            centre = stats.vector_median(peers) if len(peers) else 0.0
            peer_spread = NORMAL_MAD * stats.vector_median(np.abs(peers - centre)) if len(peers) else 0.0
            bar = np.maximum(bar, PERSISTENT_PEERS * peer_spread)
        apart = (np.abs(z_offset) >= bar) & (view.held >= PERSISTENT_HELD * n) & (n >= MIN_COLUMNS)
        below = (apart & (offset < 0)).nonzero()[0].tolist()  # for the straggler rule: any size
        if view.relative:
            apart &= np.abs(np.expm1(offset)) >= PERSISTENT_RELATIVE
    if ranks == 2:  # the two ranks mirror each other: name the higher one
        apart &= offset > 0
    offsets: dict[int, Offset] = {}
    findings = []
    timing = is_time_key(key)
    for r in apart.nonzero()[0].tolist():
        size, excess = _percent(view, values, r)
        direction = 1 if offset[r] > 0 else -1
        big = view.relative and abs(float(offset[r])) >= math.log(SPIKE_FOLD)
        severity = "warning" if n[r] >= SUSTAINED_COLUMNS or big else "info"
        held = int(view.held[r])
        peer = "rank " + str(1 - r) + "'s value" if ranks == 2 else "the median rank"
        if timing and view.relative and 0.5 < math.exp(offset[r]) < 2:
            pace = "slower" if direction > 0 else "faster"
            text = f"rank {r} is {size.split()[0]} {pace} than {peer} on {key}"
        else:
            text = f"rank {r}: {key} is {size} {peer}"
        text += f" on {held} of its {int(n[r])} {pers}"
        if ranks == 2:
            text += "; with 2 ranks this shows that they differ, not which one is wrong"
        elif severity == "info":
            text += " (too few to be sure)"
        offsets[r] = Offset(direction, size, held, int(n[r]), excess, severity)
        first = int(columns[np.argmax(~np.isnan(view.deviation[r]))])
        findings.append(_finding("persistent_outlier", r, key, first, severity, text))
    leaning = {
        r: Offset(-1, _percent(view, values, r)[0], int(view.held[r]), int(n[r]), 0.0, "info") for r in below
    }
    return offsets, leaning, findings


def _noisy(key: str, view: PeerView, noise: stats.Vector, skip: set[int], pers: str) -> list[Finding]:
    """``noisy_rank``: a rank whose own spread about its offset (a MAD: a few spikes do not move it) is
    ``NOISY_RATIO`` times the typical rank's or more, over at least ``MIN_NOISE_COLUMNS`` columns."""
    findings = []
    with np.errstate(invalid="ignore"):
        flagged = (noise >= NOISY_RATIO) & (view.n >= MIN_NOISE_COLUMNS)
    for r in flagged.nonzero()[0].tolist():
        if r in skip:
            continue
        findings.append(
            _finding(
                "noisy_rank",
                r,
                key,
                None,
                "warning",
                f"rank {r}: {key} jumps around {float(noise[r]):.1f}x as much as the typical rank "
                f"(robust spread over its {int(view.n[r])} {pers}, spikes left out)",
            )
        )
    return findings


def _runs(cols: list[int], columns: NDArray[np.int64], bin_size: int) -> str:
    """Columns as step ranges: ``steps 60-61, 90``."""
    parts: list[str] = []
    start = prev = cols[0]
    for c in [*cols[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        low, high = int(columns[start]), int(columns[prev]) + bin_size - 1
        parts.append(str(low) if low == high else f"{low}-{high}")
        if c is not None:
            start = prev = c
    shown = ", ".join(parts[:5]) + (f" and {len(parts) - 5} more" if len(parts) > 5 else "")
    return ("step " if len(parts) == 1 and "-" not in parts[0] else "steps ") + shown


def _poisson_tail(n: int, lam: float) -> float:
    """P(N >= n) for N ~ Poisson(lam)."""
    term = math.exp(-lam)
    below = 0.0
    for k in range(n):
        below += term
        term *= lam / (k + 1)
    return max(0.0, 1.0 - below)


def _spikes(
    key: str,
    view: PeerView,
    values: stats.Matrix,
    columns: NDArray[np.int64],
    bin_size: int,
    quiet: list[int],
) -> tuple[list[Finding], dict[int, list[int]]]:
    """``spike``: short runs of values far from the rank's usual place among its peers, judged against
    the other ranks. See the module's rules. Also each rank's spike columns."""
    ranks, cols = values.shape
    if cols < MIN_SPIKE_COLUMNS:
        return [], {}
    bar = spike_threshold(int(view.n.sum()), ranks)
    with np.errstate(all="ignore"):
        resid = view.deviation - view.own_offset[:, None]
        z = view.residual
        size = np.abs(resid) if view.relative else np.abs(z)
        size = np.where(np.isnan(size), -np.inf, size)
        tail = np.abs(z) >= bar
        keep = np.zeros(ranks, bool)
        keep[quiet] = True
        tail &= keep[:, None]
        beyond = tail & (np.abs(resid) >= math.log(SPIKE_FOLD)) if view.relative else tail
    having = beyond.any(axis=1).nonzero()[0].tolist()
    if not having:
        return [], {}
    largest = size.max(axis=1)
    shared = max(SHARED_SPIKE_RANKS, SHARED_SPIKE_SHARE * ranks)
    if ranks == 2 or len(having) > shared:
        return [_shared_spikes(key, view, having, beyond, largest, ranks)], {}
    # A key whose robust scores cross the bar on many ranks is heavy-tailed: its largest values are
    # further apart by chance, and a spike must stand further out.
    heavy = int(np.count_nonzero(tail.any(axis=1))) > shared
    separation = SPIKE_SEPARATION_HEAVY if heavy else SPIKE_SEPARATION
    findings = []
    cells: dict[int, list[int]] = {}
    timing = is_time_key(key)
    counts = beyond.sum(axis=1)
    total = int(counts.sum())
    for r in having:
        others = np.sort(np.delete(largest, r))[::-1]
        ceiling = float(others[1] if ranks >= 8 else others[0])
        separated = float(largest[r]) >= separation * max(ceiling, 0.0)
        lam = (total - int(counts[r]) + 1) / (ranks - 1)
        frequent = counts[r] >= 3 and _poisson_tail(int(counts[r]), lam) < SPIKE_COUNT_P
        if timing:  # stalls matter when they are a share of the rank's steps, not a few descheduled ones
            frequent = frequent and counts[r] >= STALL_SHARE * view.n[r]
        cols_r = cells[r] = beyond[r].nonzero()[0].tolist()
        worst = cols_r[int(np.argmax(size[r, cols_r]))]
        value, peers = float(values[r, worst]), float(np.broadcast_to(view.reference, values.shape)[r, worst])
        if view.relative:
            ratio = value / peers
            how = f"{ratio:.2g}x" if ratio >= 1 else f"1/{1 / ratio:.2g} of"
            within = f"; the other ranks stay within {math.exp(max(ceiling, 0.0)):.2g}x of it"
            text = f"rank {r}: {key} was {how} the median of the ranks at {_runs(cols_r, columns, bin_size)}"
        else:
            within = f"; the other ranks stay within a robust score of {max(ceiling, 0.0):.1f}"
            text = (
                f"rank {r}: {key} was {_fmt(value)} where the median of the ranks was {_fmt(peers)} "
                f"at {_runs(cols_r, columns, bin_size)} (robust score {float(largest[r]):.1f})"
            )
        # A brief stall of a time key costs a moment; only stalls far more frequent than the others' count.
        severity = "warning" if frequent or (separated and not timing) else "info"
        if severity == "info":
            within += ", a brief stall" if timing and separated else ", so this may be the key's own noise"
        findings.append(_finding("spike", r, key, int(columns[cols_r[0]]), severity, text + within))
    return findings, cells


def _shared_spikes(
    key: str, view: PeerView, having: list[int], beyond: NDArray[np.bool_], largest: stats.Vector, ranks: int
) -> Finding:
    with np.errstate(invalid="ignore"):
        up = (beyond & (view.deviation - view.own_offset[:, None] > 0)).any(axis=1).nonzero()[0].tolist()
    """One ``info`` row for outlier values that many ranks show (or that 2 ranks cannot tell apart)."""
    top = float(largest[having].max())
    size = (
        f"up to {math.exp(top):.2g}x the median rank" if view.relative else f"robust scores up to {top:.1f}"
    )
    if ranks == 2:
        text = (
            f"{key}: the 2 ranks differ briefly at {int(beyond.any(axis=0).sum())} columns ({size}); "
            "with 2 ranks this cannot tell which one is wrong"
        )
        rank = having[0] if len(having) == 1 else (up[0] if len(up) == 1 else None)
    else:
        text = (
            f"{key}: {len(having)} of {ranks} ranks have brief outlier values ({size}, "
            f"{int(beyond.sum())} in all): a rate the ranks share, so likely the key's own noise "
            "rather than one rank's fault"
        )
        rank = None
    return _finding("spike", rank, key, None, "info", text)


TIME_KEY = re.compile(r"time|latency|duration|wait|(^|[/_.])(ms|sec|secs|seconds)$", re.IGNORECASE)


def is_time_key(key: str) -> bool:
    """Whether a key's name says it measures time (``system/data_time``, ``step_ms``, ``latency``)."""
    return bool(TIME_KEY.search(key))


def cross_key_findings(
    findings: list[Finding], results: dict[str, KeyResult], node_start: NDArray[np.int64] | None = None
) -> list[Finding]:
    """The rules that look across keys and ranks: ``straggler`` and ``node_outlier``."""
    findings = _stragglers(findings, results)
    if node_start is not None and len(node_start):
        findings = _nodes(findings, node_start)
    return findings


def _stragglers(findings: list[Finding], results: dict[str, KeyResult]) -> list[Finding]:
    """A rank persistently high on one time key and low on another is the straggler the others wait
    for: its own work (data loading, compute) takes longer, and a time that includes waiting at the
    collectives is shorter for it, because it is the one the others wait for. One finding replaces
    its two ``persistent_outlier`` rows."""
    times = {k: r for k, r in results.items() if r.relative and is_time_key(k)}
    ranks = {rank for r in times.values() for rank, o in r.offsets.items() if o.direction > 0}
    replaced: set[tuple[int, str]] = set()
    added = []
    for rank in sorted(ranks):
        high = [
            (k, o)
            for k, r in times.items()
            if (o := r.offsets.get(rank)) is not None and o.direction > 0 and o.severity == "warning"
        ]
        low = [(k, r.below[rank]) for k, r in times.items() if rank in r.below]
        if not high or not low:
            continue
        (hk, ho), (lk, lo) = max(high, key=lambda x: x[1].held), max(low, key=lambda x: x[1].held)
        replaced |= {(rank, hk), (rank, lk)}
        added.append(
            _finding(
                "straggler",
                rank,
                hk,
                None,
                "warning",
                f"rank {rank} is the straggler the other ranks wait for: its {hk} is {ho.size} the median "
                f"rank on {ho.held} of {ho.columns} steps, while its {lk}, which includes waiting for the "
                f"others, is {lo.size}; the job loses about {abs(ho.excess):.2g} of {hk} a step to it",
            )
        )
    kept = [
        f for f in findings if not (f["kind"] == "persistent_outlier" and (f["rank"], f["key"]) in replaced)
    ]
    return kept + added


#: Kinds a node's ranks can share (one row per node instead of one per rank).
NODE_KINDS = ("stopped_reporting", "missing_steps", "persistent_outlier", "noisy_rank", "spike", "straggler")


def _nodes(findings: list[Finding], node_start: NDArray[np.int64]) -> list[Finding]:
    """``node_outlier``: when at least half of a node's ranks (2 or more; ``local_rank`` gives the
    layout: a node's first rank is ``rank - local_rank``) share a finding (kind and key), one row names
    the node and its ranks instead of one row per rank."""
    size: dict[int, list[int]] = {}
    for rank, start in enumerate(node_start.tolist()):
        if start >= 0:
            size.setdefault(start, []).append(rank)
    groups: dict[tuple[str, str | None, int], list[Finding]] = {}
    for f in findings:
        r = f["rank"]
        if f["kind"] in NODE_KINDS and r is not None and r < len(node_start) and node_start[r] >= 0:
            groups.setdefault((f["kind"], f["key"], int(node_start[r])), []).append(f)
    merged: set[int] = set()
    added = []
    order = {"critical": 0, "warning": 1, "info": 2}
    for (kind, key, start), rows in groups.items():
        members = size[start]
        if len(members) < 2 or len(rows) < 2 or 2 * len(rows) < len(members):
            continue
        merged |= {id(f) for f in rows}
        severity = min((f["severity"] for f in rows), key=order.__getitem__)
        span = (
            f"{members[0]}-{members[-1]}"
            if members == list(range(members[0], members[-1] + 1))
            else (", ".join(map(str, members)))
        )
        added.append(
            _finding(
                "node_outlier",
                start,
                key,
                min((f["step"] for f in rows if f["step"] is not None), default=None),
                severity,
                f"the node of ranks {span}: {len(rows)} of its {len(members)} ranks share one finding "
                f"({kind.replace('_', ' ')}{' on ' + key if key else ''}), so the cause is likely the node "
                f"(host, network, storage); for example: {rows[0]['message']}",
            )
        )
    return [f for f in findings if id(f) not in merged] + added


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
