"""Peers: each value of a key against its peers' (:class:`PeerView`), and the ranks that sit apart
from them or move more than they do. No I/O.

Each value is compared with the median of the ranks at the same column (with 2 ranks, with the other
rank); for a rank's persistent offset, from 4 to ``LEAVE_ONE_OUT_RANKS`` ranks, with the median of the
*other* ranks (in a small world a rank pulls the median of all towards itself). For a key whose values
are all > 0 (times, losses, token counts) the comparison is a ratio (a log difference), so sizes read as
"30% above" or "8x" whatever the key's level; for other keys it is a difference. A rank's *offset* is
the median of its deviations over its columns; its *spread* is the mean distance of its deviations (in
units of each column's spread across ranks, pooled over ``SPIKE_POOL_COLUMNS`` adjacent columns) from
its own median, its largest ``SPREAD_TRIM`` left out. Both are robust: a few spikes move neither. The
*typical* spread is the median spread of the ranks.

- ``persistent_outlier``: a rank's offset is (1) beyond ``PERSISTENT_SE`` standard errors of a median
  (``MEDIAN_SE`` x typical spread / ``TRIMMED_NORMAL`` / sqrt(columns)), (2) from 3 ranks on, beyond
  ``PERSISTENT_PEERS`` x the spread of the ranks' own offsets (1.4826 x their MAD), (3) on one side on at
  least ``PERSISTENT_HELD`` of its columns, and (4) for a positive key, at least ``PERSISTENT_RELATIVE``
  of its peers' level. ``warning`` over ``SUSTAINED_COLUMNS`` columns or more, or when the rank is at
  least ``SPIKE_FOLD`` x (or 1/``SPIKE_FOLD``) its peers; ``info`` over ``MIN_COLUMNS`` to
  ``SUSTAINED_COLUMNS``. With 2 ranks the higher one is named and the message says that 2 ranks show
  a difference, not which one is wrong.
- ``noisy_rank`` (warning, from ``MIN_NOISE_RANKS`` ranks): a rank not persistently apart whose spread
  is ``NOISY_RATIO`` x the typical spread or more, over ``MIN_NOISE_COLUMNS`` columns or more, beyond
  chance (a rank-sum test of its distances against its peers' at ``NOISY_P``, shared among the ranks:
  heavy-tailed, bursty noise every rank has is not a rank's), and on a time key at least
  ``NOISY_MATERIAL`` of its own level (a 2 ms descheduling pattern on a 100 ms step is nobody's fault).

A rank persistently apart is judged by these rules alone (its :class:`Offset` feeds the ``straggler``
rule of ``nodes``); a noisy one too: spikes are looked for among the other ranks. ``SPIKE_FOLD`` is
``common``'s (the spikes use it too).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from shared import stats
from shared.findings.common import SPIKE_FOLD, Finding, _finding, _fmt, _share, is_time_key
from shared.severity import Severity

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
#: A noisy rank's distances from its own place must be larger than its peers' beyond chance: a rank-sum
#: test (``stats.rank_sum_p_rows``: the values' order only, whatever the tails and bursts of the noise) at
#: this level, shared among the ranks (Bonferroni).
NOISY_P = 1e-3
#: A time key's noise is a finding from this share of the rank's own level on: a 2 ms descheduling on a
#: 100 ms step moves nothing a person would act on.
NOISY_MATERIAL = 0.05
#: Spikes are scored against the median MAD of this many adjacent columns.
SPIKE_POOL_COLUMNS = 21
#: A rank's spread leaves out its largest distances, this share of them (spikes are not noise).
SPREAD_TRIM = 0.1
#: ... which is 0.657 standard deviations for normal noise.
TRIMMED_NORMAL = 0.657
#: 1.4826 x MAD estimates a normal standard deviation; 1.2533 sigma / sqrt(n) is a median's standard error.
NORMAL_MAD = 1.4826
MEDIAN_SE = 1.2533


@dataclass(frozen=True)
class Offset:
    """A rank persistently apart from its peers on one key (what the cross-key rules combine)."""

    direction: int  # +1 above its peers, -1 below
    size: str  # "30% above", "4.1x", "0.12 above"
    held: int  # columns on that side
    columns: int  # columns compared
    excess: float  # median of (its value - its peers' median), in the key's units
    severity: Severity


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
        severity: Severity = "warning" if n[r] >= SUSTAINED_COLUMNS or big else "info"
        held = int(view.held[r])
        peer = "rank " + str(1 - r) + "'s value" if ranks == 2 else "the median rank"
        if timing and view.relative and 0.5 < math.exp(offset[r]) < 2:
            pace = "slower" if direction > 0 else "faster"
            text = f"rank {r} is {size.split()[0]} {pace} than {peer} on {key}"
        else:
            text = f"rank {r}: {key} is {size} {peer}"
        text += " " + _share(held, int(n[r]), pers)
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


def noisy_ranks(key: str, view: PeerView, noise: stats.Vector) -> NDArray[np.bool_]:
    """The ranks whose own spread about their place (trimmed: a few spikes do not move it) is
    ``NOISY_RATIO`` times the typical rank's or more over at least ``MIN_NOISE_COLUMNS`` columns, beyond
    chance among their peers (``NOISY_P``) and, on a time key, by at least ``NOISY_MATERIAL`` of their
    own level."""
    with np.errstate(invalid="ignore"):
        flagged = (noise >= NOISY_RATIO) & (view.n >= MIN_NOISE_COLUMNS)
    candidates = flagged.nonzero()[0].tolist()
    if not candidates:
        return flagged
    ranks = len(noise)
    p = stats.rank_sum_p_rows(np.abs(view.residual))
    timing = is_time_key(key)
    for r in candidates:
        if p[r] >= NOISY_P / ranks:
            flagged[r] = False
        elif timing:
            flagged[r] = _jitter_share(view, r) >= NOISY_MATERIAL
    return flagged


def _jitter_share(view: PeerView, r: int) -> float:
    """Rank ``r``'s spread about its own place as a share of the key's level: its deviations are log
    ratios when every value is > 0, else in the key's units (a time key with zeros: against the
    peers' median level)."""
    jitter = float(_trimmed_spread(np.abs(view.deviation[r] - view.own_offset[r])[None, :])[0])
    if view.relative:
        return math.expm1(jitter)
    level = _median_of_row(np.abs(np.asarray(view.reference, dtype=np.float64)).ravel())
    return jitter / level if level > 0 else math.inf


def _noisy(key: str, view: PeerView, noise: stats.Vector, skip: set[int], pers: str) -> list[Finding]:
    """``noisy_rank`` (see :func:`noisy_ranks`), for the ranks not persistently apart (``skip``)."""
    findings = []
    flagged = noisy_ranks(key, view, noise)
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
