"""System metrics (contract 2): the memory and GPU each rank's process reported of itself
(``instantml.monitor.system``), against its peers'. No I/O.

The generic rules of ``peers`` and ``spikes`` do not judge these keys: a process's memory is not noise
around a level (it steps up when the allocator takes more, and rank 0 often holds more for its logging
and evaluation), and what matters is a rank apart by a large margin, or one still growing where its
peers have stopped. Each rule reads a rank's latest points (finite cells of the binned ``ranks x columns``
matrix, at the columns' first steps):

- ``memory_growth`` (warning), on ``system/rss_mb`` and ``system/gpu_memory_mb``: over its last
  ``GROWTH_POINTS`` points (``MIN_GROWTH_POINTS`` at least), a rank's memory grew by ``GROWTH_MIN_MB`` and
  ``GROWTH_MIN_SHARE`` of its level or more (its Theil-Sen slope over the points' span), rose by
  ``RISE_MIN_MB`` or more on ``GROWTH_RISING`` of its successive points or more, still rose over the
  later half of them at half that rate or more, sits higher over that later half (the median of its
  values) by half what the slope says or more (an evaluation's brief hump moves no median), and grew
  ``GROWTH_PEERS`` x as much as the median of its peers or more (warm-up growth every rank shares is
  nobody's). The row forecasts the step at which, at that rate, it reaches
  its limit (``system/memory_limit_mb``: the cgroup's ``memory.max`` or the machine's; for the GPU,
  ``system/gpu_memory_total_mb``, the device's), where the rank reported it.
- ``memory_high`` (warning), on the same keys, from ``MIN_HIGH_RANKS`` ranks: a rank whose median over its
  last ``HIGH_POINTS`` points is ``HIGH_FOLD`` x the median of its peers' or more, and
  ``HIGH_MIN_MB`` above it, on ``HIGH_POINTS`` points at least; not said of a rank growing on that key
  (its ``memory_growth`` row says more).
- ``gpu_idle`` (warning), on ``system/gpu_util_percent``, from ``MIN_HIGH_RANKS`` ranks: a rank whose
  median utilisation over its last ``HIGH_POINTS`` points is at most ``IDLE_SHARE`` of its peers' median,
  ``IDLE_MIN_GAP`` points below it, while its peers' is ``IDLE_PEERS_BUSY`` or more: a GPU starved while
  the others work (its data loading, most often).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from instantml.monitor import system as sampled
from shared.findings.common import Finding, _finding

#: The memory keys judged, each with the key of its limit.
MEMORY_KEYS = {
    "system/rss_mb": "system/memory_limit_mb",
    "system/gpu_memory_mb": "system/gpu_memory_total_mb",
}
UTIL_KEY = "system/gpu_util_percent"
GROWTH_POINTS = 24
MIN_GROWTH_POINTS = 5
GROWTH_MIN_MB = 100.0
GROWTH_MIN_SHARE = 0.05
GROWTH_RISING = 0.75
#: A rise between two points smaller than this is not one (the interpreter's creep of a few KB).
RISE_MIN_MB = 1.0
GROWTH_PEERS = 4.0
MIN_HIGH_RANKS = 3
#: Points a level is the median of: a rank apart for a moment (its evaluation) is not.
HIGH_POINTS = 12
HIGH_FOLD = 2.0
HIGH_MIN_MB = 512.0
IDLE_SHARE = 0.5
IDLE_MIN_GAP = 25.0
IDLE_PEERS_BUSY = 40.0


def is_system_key(key: str) -> bool:
    """Whether ``key`` is one the client samples by itself (a user's own ``system/...`` key is not)."""
    return key in sampled.KEYS


def system_findings(values: Mapping[str, NDArray[np.float64]], columns: NDArray[np.int64]) -> list[Finding]:
    """The rows of this family from the binned matrices of the system keys present (``values[key]``,
    ranks x columns, NaN where a rank has no sample) and each column's first step."""
    rows: list[Finding] = []
    for key, limit_key in MEMORY_KEYS.items():
        matrix = values.get(key)
        if matrix is None:
            continue
        growing = _growth(key, matrix, values.get(limit_key), columns)
        rows += growing
        rows += _high(key, matrix, {f["rank"] for f in growing})
    if UTIL_KEY in values:
        rows += _idle(values[UTIL_KEY])
    return rows


def _points(
    row: NDArray[np.float64], columns: NDArray[np.int64], last: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """A rank's last ``last`` finite cells: their steps and values."""
    at = np.flatnonzero(np.isfinite(row))[-last:]
    return columns[at].astype(np.float64), row[at]


def _theil_sen(steps: NDArray[np.float64], values: NDArray[np.float64]) -> float:
    """The median of the pairwise slopes (a few outlying points do not move it)."""
    i, j = np.triu_indices(len(steps), 1)
    span = steps[j] - steps[i]
    keep = span > 0
    if not keep.any():
        return 0.0
    return float(np.median((values[j] - values[i])[keep] / span[keep]))


class _Trend:
    """A rank's memory over its latest points: how fast it grows and how steadily."""

    __slots__ = (
        "grew",
        "half_span",
        "last_step",
        "later_rate",
        "level",
        "now",
        "points",
        "rate",
        "rising",
        "shift",
    )

    def __init__(self, steps: NDArray[np.float64], values: NDArray[np.float64]) -> None:
        self.points = len(values)
        self.rate = _theil_sen(steps, values)  # MB a step
        self.grew = self.rate * float(steps[-1] - steps[0])
        self.level = float(np.median(values[: max(1, len(values) // 4)]))  # where it started, about
        self.last_step = float(steps[-1])
        self.now = float(np.median(values - self.rate * steps)) + self.rate * self.last_step  # the fit's
        diffs = np.diff(values)
        self.rising = float(np.mean(diffs > RISE_MIN_MB)) if len(diffs) else 0.0
        half = len(steps) // 2
        self.later_rate = _theil_sen(steps[half:], values[half:])
        # Where the later half of the points sits above the earlier half (medians: a brief hump, as an
        # evaluation's, moves neither).
        self.shift = float(np.median(values[half:]) - np.median(values[:half]))
        self.half_span = float(np.median(steps[half:]) - np.median(steps[:half]))


def _growth(
    key: str, matrix: NDArray[np.float64], limits: NDArray[np.float64] | None, columns: NDArray[np.int64]
) -> list[Finding]:
    trends: dict[int, _Trend] = {}
    for rank in range(matrix.shape[0]):
        steps, points = _points(matrix[rank], columns, GROWTH_POINTS)
        if len(points) >= MIN_GROWTH_POINTS:
            trends[rank] = _Trend(steps, points)
    rows: list[Finding] = []
    grown = {rank: max(0.0, t.grew) for rank, t in trends.items()}
    peer_growths = _peer_medians(grown) if len(grown) > 1 else {}
    for rank, t in trends.items():
        peers = rank in peer_growths
        peer_growth = peer_growths.get(rank, 0.0)
        big = t.grew >= GROWTH_MIN_MB and t.grew >= GROWTH_MIN_SHARE * max(t.level, 0.0)
        steady = (
            t.rising >= GROWTH_RISING
            and t.later_rate >= 0.5 * t.rate
            and t.shift >= 0.5 * t.rate * t.half_span
        )
        if not (big and steady and t.grew >= GROWTH_PEERS * peer_growth):
            continue
        peers_text = (
            f"while its peers' grew {peer_growth:,.0f} MB over the same points"
            if peers
            else "(no peers reported it)"
        )
        message = (
            f"rank {rank}'s memory ({key}) keeps growing: {t.rate:,.2f} MB a step, {t.grew:,.0f} MB over its "
            f"last {t.points} samples to step {t.last_step:,.0f}, "
            f"{peers_text}"
        )
        limit = _latest(limits, rank) if limits is not None else None
        reach = None if limit is None else round(t.last_step + max(0.0, limit - t.now) / t.rate)
        if reach is not None:
            message += f"; at that rate it reaches its limit of {limit:,.0f} MB at about step {reach:,}"
        row = _finding("memory_growth", rank, key, int(t.last_step), "warning", message)
        if reach is not None:
            row["forecast_step"] = reach
        rows.append(row)
    return rows


def _latest(matrix: NDArray[np.float64], rank: int) -> float | None:
    if rank >= matrix.shape[0]:
        return None
    at = np.flatnonzero(np.isfinite(matrix[rank]))
    return float(matrix[rank, at[-1]]) if len(at) else None


def _levels(matrix: NDArray[np.float64]) -> dict[int, float]:
    """Each rank's median over its last ``HIGH_POINTS`` samples, for the ranks with that many."""
    out = {}
    for rank in range(matrix.shape[0]):
        points = matrix[rank][np.isfinite(matrix[rank])][-HIGH_POINTS:]
        if len(points) >= HIGH_POINTS:
            out[rank] = float(np.median(points))
    return out


def _peer_medians(values: dict[int, float]) -> dict[int, float]:
    """Each rank's peers' median: the median of the others' values (one sort, whatever the ranks)."""
    ranks = list(values)
    v = np.array([values[r] for r in ranks])
    order = np.argsort(v, kind="stable")
    ordered, n = v[order], len(v)
    at = np.empty(n, np.int64)
    at[order] = np.arange(n)

    def kth(k: int) -> NDArray[np.float64]:  # each rank's others, sorted: their k-th value
        picked: NDArray[np.float64] = np.where(k < at, ordered[k], ordered[min(k + 1, n - 1)])
        return picked

    m = n - 1
    medians = kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2
    return dict(zip(ranks, medians.tolist(), strict=True))


def _apart(matrix: NDArray[np.float64]) -> list[tuple[int, float, float]]:
    """(rank, its level, its peers' median level) of each rank with a level, from ``MIN_HIGH_RANKS``."""
    levels = _levels(matrix)
    if len(levels) < MIN_HIGH_RANKS:
        return []
    peers = _peer_medians(levels)
    return [(rank, level, peers[rank]) for rank, level in levels.items()]


def _high(key: str, matrix: NDArray[np.float64], growing: set[int | None]) -> list[Finding]:
    rows: list[Finding] = []
    for rank, level, peers in _apart(matrix):
        if rank in growing or level < HIGH_FOLD * peers or level - peers < HIGH_MIN_MB:
            continue
        fold = level / peers if peers > 0 else float("inf")
        message = (
            f"rank {rank} holds {level:,.0f} MB ({key}), {fold:.1f}x the median of its peers' "
            f"{peers:,.0f} MB, over its last {HIGH_POINTS} samples"
        )
        rows.append(_finding("memory_high", rank, key, None, "warning", message))
    return rows


def _idle(matrix: NDArray[np.float64]) -> list[Finding]:
    rows: list[Finding] = []
    for rank, level, peers in _apart(matrix):
        if peers < IDLE_PEERS_BUSY or level > IDLE_SHARE * peers or peers - level < IDLE_MIN_GAP:
            continue
        message = (
            f"rank {rank}'s GPU is {level:.0f}% busy ({UTIL_KEY}, its last {HIGH_POINTS} samples) while its "
            f"peers' are {peers:.0f}%: it waits, most often on its data loading"
        )
        rows.append(_finding("gpu_idle", rank, UTIL_KEY, None, "warning", message))
    return rows
