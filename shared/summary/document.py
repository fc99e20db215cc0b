"""The Distributed summary of one run (contract 5) as a document, from the run's decoded events or units
(pure numpy, no I/O): reduce (``shared.stats``), explain (``shared.findings``) and lay it out. What a
summary reads through the store port, and which level of rollups serves it, is
``shared.summary.reads``; the query is parsed by ``shared.summary.query``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict, TypeVar

import numpy as np
from numpy.typing import NDArray

from shared import findings as explain
from shared import rollups, stats
from shared.findings import Finding
from shared.summary.decoding import DecodedRun, units_from_run
from shared.summary.query import SummaryQuery

T = TypeVar("T", bound=np.generic)

HEATMAP_Z_DECIMALS = 3
#: z and score of outlier rows, and a rank's mean z and noise, are statistics read by a person (the
#: values, means and deltas beside them keep every digit): 3 decimals, as the heatmap's z, keep a
#: 512-rank document and its refreshes small.
SCORE_DECIMALS = 3
#: The reducers of contract 5.2, in the document's order (``nonfinite`` follows them).
STATISTICS = ("count", "mean", "weighted_mean", "min", "max", "range", "std", "p05", "p50", "p95")


class Coverage(TypedDict):
    """Per column: the ranks its world size expects, how many reported its every step, and the others."""

    expected: list[int]
    reported: list[int]
    missing: list[list[int]]


class Outlier(TypedDict):
    """A cell whose score reaches the query's threshold (contract 5.4)."""

    key: str
    step: int
    rank: int
    value: float
    mean: float
    delta: float
    z: float
    score: float
    alarm: bool  # a warning or critical finding stands behind the cell


class RankKey(TypedDict):
    """One rank's figures on one key."""

    mean_z: float | None
    noise: float | None
    outlier_steps: int


class RankStat(TypedDict):
    rank: int
    steps_reported: int
    first_step: int | None
    last_step: int | None
    keys: dict[str, RankKey]


class Resolution(TypedDict):
    """What ``distributed_summary`` read to make the document."""

    unit: Literal["step", "level"]
    level_steps: int
    rollup_blocks_read: int
    events_read: int
    late_steps_read: int
    complete_through_step: int | None  # None: the whole window; else where the reading stopped


class _Document(TypedDict):
    project: str
    run_id: str
    keys: list[str]
    world_size: int
    ranks: list[int]
    step_min: int | None
    step_max: int | None
    bin_size: int
    steps: list[int]
    reducers: dict[str, dict[str, list[Any]]]
    coverage: Coverage
    heatmap: dict[str, dict[str, Any]]
    outliers: list[Outlier]
    rank_stats: list[RankStat]
    findings: list[Finding]


class Summary(_Document, total=False):  # (total=False: see shared.findings.common.Finding)
    """The contract 5.1 document, its keys in the order it is written. ``heatmap[key]`` holds ``values``
    and ``z``: numpy matrices (``arrays``, for ``shared.summary.wire``) or contract 5.1's lists."""

    resolution: Resolution  # a summary read from the store (``distributed_summary``)
    processes: list[dict[str, Any]]  # contract 8, from the run's record (``shared.runs.summary_processes``)


def _json_list(array: NDArray[Any]) -> list[Any]:
    """A numpy vector or matrix as JSON lists, ``null`` for NaN or Infinity."""
    if array.dtype.kind in "iub":
        return array.tolist()  # type: ignore[no-any-return]
    out = array.astype(object)
    out[~np.isfinite(array)] = None
    return out.tolist()  # type: ignore[no-any-return]


def summarize(
    run: DecodedRun, project: str, run_id: str, query: SummaryQuery, arrays: bool = False
) -> Summary:
    """The contract 5.1 document for a decoded run, one unit per distinct step (exact); ``arrays``:
    the heatmap as numpy matrices (``shared.summary.wire`` encodes them) instead of JSON lists."""
    steps = _window_steps(run, query)
    world_size = int(run.event_world_size.max()) if len(run.event_world_size) else 0
    units = units_from_run(run, steps, np.arange(len(steps)), len(steps), world_size)
    keys = [k for k in (query.keys or sorted(run.keys)) if k in run.keys]
    return summarize_units(units, keys, project, run_id, query, arrays=arrays)


def _window_steps(run: DecodedRun, query: SummaryQuery) -> NDArray[np.int64]:
    steps = np.unique(run.event_step)
    if query.step_min is not None:
        steps = steps[steps >= query.step_min]
    if query.step_max is not None:
        steps = steps[steps <= query.step_max]
    return steps


def summarize_units(
    units: rollups.Units,
    keys: list[str],
    project: str,
    run_id: str,
    query: SummaryQuery,
    resolution: Resolution | None = None,
    arrays: bool = False,
) -> Summary:
    """The contract 5.1 document from units, grouped into at most ``query.max_steps`` columns; with
    ``arrays``, ``heatmap[key]`` holds numpy matrices (``values``, ``z``) for ``shared.summary.wire``."""
    grid = _grid(units, query.max_steps)
    first_seen, last_seen = _seen(units)
    run_last = int(units.last_step[grid.used].max()) if len(grid.used) else None
    findings = explain.coverage_findings(
        units.raw_present,
        units.raw_world_size,
        units.raw_steps,
        last_seen,
        first_seen,
        run_last,
        _rolled_coverage(units, first_seen, last_seen),
    )
    # In the order asked, not a dict: a key asked twice (keys=a,a) adds its rows twice, as it always has.
    parts = [(key, _key_part(key, units.keys[key], grid, query)) for key in keys]
    for _, part in parts:
        findings += part.result.findings
    system = {key: part.heatmap["values"] for key, part in parts if explain.is_system_key(key)}
    findings += explain.system_findings(system, grid.columns)
    results = {key: part.result for key, part in parts}
    findings = explain.cross_key_findings(findings, results, units.node_start)
    heatmap = {key: part.heatmap for key, part in parts}
    summary: Summary = {
        "project": project,
        "run_id": run_id,
        "keys": keys,
        "world_size": units.present.shape[0],
        "ranks": list(range(units.present.shape[0])),
        "step_min": int(units.first_step[grid.used].min()) if len(grid.used) else query.step_min,
        "step_max": run_last if len(grid.used) else query.step_max,
        "bin_size": grid.bin_size,
        "steps": grid.columns.tolist(),
        "reducers": {key: part.reducers for key, part in parts},
        "coverage": _coverage(grid),
        "heatmap": heatmap if arrays else heatmap_lists(heatmap),
        "outliers": _capped([row for _, part in parts for row in part.outliers], query.outlier_limit),
        "rank_stats": _rank_stats(units, first_seen, last_seen, parts),
        "findings": explain.worst_first(findings),
    }
    if resolution is not None:
        summary["resolution"] = resolution
    return summary


def _group_sum(matrix: NDArray[T], starts: NDArray[np.int64]) -> NDArray[T]:
    """Sums of consecutive column groups beginning at ``starts``."""
    if matrix.shape[-1] == 0:
        return matrix
    result: NDArray[T] = np.add.reduceat(matrix, starts, axis=-1)
    return result


@dataclass(frozen=True)
class _Grid:
    """The document's columns: each a group of consecutive units that hold steps."""

    used: NDArray[np.int64]  # the units that hold steps
    starts: NDArray[np.int64]  # each column's first place among ``used``
    columns: NDArray[np.int64]  # each column's first step
    col_steps: NDArray[np.int64]  # the steps each column claims
    bin_size: int
    expected: NDArray[np.int64]  # the ranks each column's world size expects
    every_step: NDArray[np.bool_]  # ranks x columns: the rank reported every step of the column

    def sum(self, per_unit: NDArray[T]) -> NDArray[T]:
        """A ranks x units matrix summed into the columns."""
        return _group_sum(per_unit[:, self.used], self.starts)


def _grid(units: rollups.Units, max_steps: int) -> _Grid:
    """At most ``max_steps`` columns over the units that hold steps, each of as many units."""
    used = np.nonzero(units.n_steps > 0)[0]
    n_units = len(used)
    group = max(1, -(-n_units // max_steps))
    starts = np.arange(0, n_units, group)
    n_cols = len(starts)
    columns = units.first_step[used][starts] if n_units else np.zeros(0, np.int64)
    col_steps = _group_sum(units.n_steps[used], starts)
    bin_size = int(col_steps.max()) if n_cols else 1
    expected = np.maximum.reduceat(units.world_size[used], starts) if n_cols else np.zeros(0, np.int64)
    every_step = _group_sum(units.present[:, used], starts) == col_steps
    return _Grid(used, starts, columns, col_steps, bin_size, expected, every_step)


def _seen(units: rollups.Units) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Each rank's first and last step over every unit (-1: never)."""
    big = np.iinfo(np.int64).max
    first_seen = np.where(units.rank_first >= 0, units.rank_first, big).min(axis=1, initial=big)
    first_seen[first_seen == big] = -1
    return first_seen, units.rank_last.max(axis=1, initial=-1)


def _coverage(grid: _Grid) -> Coverage:
    """Per column, the ranks expected, how many reported every step, and which did not (contract 5.3)."""
    ranks = np.arange(grid.every_step.shape[0])
    below_expected = ranks[:, None] < grid.expected[None, :]
    reported = (grid.every_step & below_expected).sum(axis=0)
    missing = [
        ranks[below_expected[:, c] & ~grid.every_step[:, c]].tolist() for c in range(len(grid.columns))
    ]
    return {"expected": grid.expected.tolist(), "reported": reported.tolist(), "missing": missing}


class _KeyPart(NamedTuple):
    """What one key adds to the document."""

    reducers: dict[str, list[Any]]
    heatmap: dict[str, NDArray[np.float64]]  # values and z, ranks x columns
    outliers: list[Outlier]  # every flagged cell, not capped yet
    result: explain.KeyResult
    ranks: list[RankKey]  # by rank


def _key_part(key: str, k: rollups.KeyUnits, grid: _Grid, query: SummaryQuery) -> _KeyPart:
    """One key's columns: its reducers, heatmap, outlier cells, findings and each rank's figures."""
    count = grid.sum(k.count)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(count > 0, grid.sum(k.total) / count, np.nan)
    col_weights = grid.sum(k.weight)
    nonfinite = grid.sum(k.nonfinite) > 0
    # Cells built from every step of the column: only those can be compared value for value.
    complete = grid.every_step & (count == grid.col_steps)
    red = stats.reducers(values, col_weights)
    reducers = {name: _json_list(getattr(red, name)) for name in STATISTICS}
    reducers["nonfinite"] = nonfinite.sum(axis=0).tolist()
    z, score = stats.scores(values, red, query.outlier_method)
    flagged = np.abs(np.nan_to_num(score)) >= query.outlier_threshold
    result = explain.key_findings(
        key, values, col_weights, red, nonfinite, complete, grid.columns, grid.bin_size
    )
    alarm = result.alarm  # an alarm where a warning or critical finding stands behind the cell
    outliers: list[Outlier] = [
        {
            "key": key,
            "step": int(grid.columns[c]),
            "rank": int(r),
            "value": float(values[r, c]),
            "mean": float(red.mean[c]),
            "delta": float(values[r, c] - red.mean[c]),
            "z": float(z[r, c]),
            "score": float(score[r, c]),
            "alarm": bool(alarm is not None and alarm[r, c]),
        }
        for r, c in zip(*np.nonzero(flagged), strict=True)
    ]
    # z to 3 decimals: it only colours cells, and full digits would double a 512-rank response.
    heatmap = {"values": values, "z": np.round(z, HEATMAP_Z_DECIMALS)}
    return _KeyPart(reducers, heatmap, outliers, result, _rank_keys(z, result.noise, flagged))


def _rank_keys(
    z: NDArray[np.float64], noise: NDArray[np.float64], flagged: NDArray[np.bool_]
) -> list[RankKey]:
    """Each rank's mean z, noise and outlier cells on one key."""
    with np.errstate(all="ignore"):
        has_z = ~np.isnan(z)
        n_z = has_z.sum(axis=1)
        mean_z = np.where(has_z, z, 0.0).sum(axis=1) / n_z
    return [
        {
            "mean_z": round(float(mean_z[r]), SCORE_DECIMALS) if n_z[r] else None,
            "noise": round(float(noise[r]), SCORE_DECIMALS) if np.isfinite(noise[r]) else None,
            "outlier_steps": int(flagged[r].sum()),
        }
        for r in range(len(z))
    ]


def _capped(outliers: list[Outlier], limit: int) -> list[Outlier]:
    """The outlier cells of the largest scores, at most ``limit`` per key (the tab shows one key at a
    time), ordered and capped by the full scores and shown to 3 decimals."""
    outliers.sort(key=lambda row: -abs(row["score"]))
    per_key: dict[str, int] = {}
    capped = []
    for row in outliers:
        if per_key.get(row["key"], 0) < limit:
            per_key[row["key"]] = per_key.get(row["key"], 0) + 1
            capped.append(row)
    for row in capped:
        row["z"], row["score"] = round(row["z"], SCORE_DECIMALS), round(row["score"], SCORE_DECIMALS)
    return capped


def _rank_stats(
    units: rollups.Units,
    first_seen: NDArray[np.int64],
    last_seen: NDArray[np.int64],
    parts: list[tuple[str, _KeyPart]],
) -> list[RankStat]:
    steps_reported = units.present.sum(axis=1)
    return [
        {
            "rank": r,
            "steps_reported": int(steps_reported[r]),
            "first_step": int(first_seen[r]) if last_seen[r] >= 0 else None,
            "last_step": int(last_seen[r]) if last_seen[r] >= 0 else None,
            "keys": {key: part.ranks[r] for key, part in parts},
        }
        for r in range(len(steps_reported))
    ]


def heatmap_lists(heatmap: dict[str, dict[str, NDArray[np.float64]]]) -> dict[str, dict[str, list[Any]]]:
    """The heatmap's matrices as contract 5.1's lists (``null`` for no value)."""
    return {key: {name: _json_list(m) for name, m in cells.items()} for key, cells in heatmap.items()}


def _rolled_coverage(
    units: rollups.Units, first_seen: NDArray[np.int64], last_seen: NDArray[np.int64]
) -> explain.RolledCoverage | None:
    """Per rank, what the rolled-up units (no single steps there) add to the coverage findings.

    A rank's steps ``first_seen..last_seen`` cover whole units, except the unit holding its first step
    (counted from there: the unit's steps minus those before it) and the one holding its last (counted
    up to it: the steps before its first in the unit plus those from its first to its last).
    """
    rolled = units.rolled & (units.n_steps > 0) if len(units.rolled) else None
    if rolled is None or not rolled.any():
        return None
    ranks = np.arange(units.present.shape[0])[:, None]
    expected = rolled[None, :] & (ranks < units.world_size[None, :])
    n = np.broadcast_to(units.n_steps[None, :], units.present.shape)
    lead, span = units.rank_lead, units.rank_span
    start, end = units.first_step[None, :], units.last_step[None, :]
    holds_first = (start <= first_seen[:, None]) & (first_seen[:, None] <= end)
    holds_last = (start <= last_seen[:, None]) & (last_seen[:, None] <= end)
    whole = (start > first_seen[:, None]) & (end < last_seen[:, None])
    steps = np.select(
        [holds_first & holds_last, holds_first, holds_last, whole], [span, n - lead, lead + span, n], 0
    )
    steps = np.where(expected, steps, 0)
    missed = np.where(expected, np.maximum(steps - units.present, 0), 0)
    after = np.where(start > last_seen[:, None], n, np.where(holds_last, n - lead - span, 0))
    first_gap = np.where(missed > 0, start, np.iinfo(np.int64).max).min(axis=1)
    return explain.RolledCoverage(
        behind=np.where(expected, after, 0).sum(axis=1),
        missed=missed.sum(axis=1),
        span=steps.sum(axis=1),
        first_gap_step=np.where(first_gap == np.iinfo(np.int64).max, -1, first_gap),
    )
