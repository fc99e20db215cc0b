"""Spikes: brief values far from a rank's usual place among its peers (its own offset in the
:class:`~shared.findings.peers.PeerView`), judged against the other ranks' rate. No I/O.

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
  ranks than the shared rate allows, whatever their size), or when it has 3 or more such values and
  the other ranks' rate makes that many less likely than ``SPIKE_COUNT_P`` (Poisson); otherwise
  ``info``. On a time key (``TIME_KEY``) a brief spike is a
  stall, which costs a moment: only the count makes it a ``warning``, and only when the stalls are also
  ``STALL_SHARE`` of the rank's columns or more (a process descheduled a few times is not a fault).
  With 2 ranks spikes are ``info``: nothing tells which rank is wrong.

The column's spread and ``SPIKE_POOL_COLUMNS`` are the peer view's (``peers``); ``SPIKE_FOLD`` and
``TIME_KEY`` are ``common``'s.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from shared import stats
from shared.findings.common import SPIKE_FOLD, Finding, _finding, _fmt, _poisson_tail, is_time_key
from shared.findings.peers import PeerView
from shared.severity import Severity

SPIKE_FALSE_ALARM_RATE = 0.01
MIN_SPIKE_COLUMNS = 10
SPIKE_SEPARATION = 2.5
SPIKE_SEPARATION_HEAVY = 4.0
SHARED_SPIKE_RANKS = 2
SHARED_SPIKE_SHARE = 0.1
SPIKE_COUNT_P = 1e-4
STALL_SHARE = 0.1


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
        severity: Severity = "warning" if frequent or (separated and not timing) else "info"
        if severity == "info":
            within += ", a brief stall" if timing and separated else ", so this may be the key's own noise"
        findings.append(_finding("spike", r, key, int(columns[cols_r[0]]), severity, text + within))
    return findings, cells


def _shared_spikes(
    key: str, view: PeerView, having: list[int], beyond: NDArray[np.bool_], largest: stats.Vector, ranks: int
) -> Finding:
    """One ``info`` row for outlier values that many ranks show (or that 2 ranks cannot tell apart)."""
    with np.errstate(invalid="ignore"):
        up = (beyond & (view.deviation - view.own_offset[:, None] > 0)).any(axis=1).nonzero()[0].tolist()
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
