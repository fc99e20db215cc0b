"""The Distributed summary of one run (contract 5): read the run's events through the store port
(``distributed_summary``), decode them (``shared.decoding``), reduce (``shared.stats``), explain
(``shared.findings``) and lay out the document. The query is parsed by ``shared.query``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypedDict, TypeVar

import numpy as np
from numpy.typing import NDArray

from shared import findings as explain
from shared import rollups, stats
from shared.decoding import DecodedRun, decode, units_from_run
from shared.findings import Finding
from shared.query import SummaryQuery
from shared.store.port import SummaryStore

T = TypeVar("T", bound=np.generic)

#: At most about this many events are read per summary (a store may set fewer: ``raw_read_budget``); a
#: window with more events beyond the rollups' progress mark is summarized up to where the reading
#: stopped, and says so (``resolution.complete_through_step`` and a ``partial`` finding).
RAW_READ_BUDGET = 400_000
#: At most this many steps that a late rank's events reached after they were rolled up are read event
#: by event (``late_steps``); beyond them a summary shows the blocks as rolled until the rollups catch up.
LATE_STEPS_READ = 2_000
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
    and ``z``: numpy matrices (``arrays``, for ``shared.wire``) or contract 5.1's lists."""

    resolution: Resolution  # a summary read from the store (``distributed_summary``)


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
    the heatmap as numpy matrices (``shared.wire`` encodes them) instead of JSON lists."""
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
    ``arrays``, ``heatmap[key]`` holds numpy matrices (``values``, ``z``) for ``shared.wire``."""
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
        return rollups.group_sum(per_unit[:, self.used], self.starts)


def _grid(units: rollups.Units, max_steps: int) -> _Grid:
    """At most ``max_steps`` columns over the units that hold steps, each of as many units."""
    used = np.nonzero(units.n_steps > 0)[0]
    n_units = len(used)
    group = max(1, -(-n_units // max_steps))
    starts = np.arange(0, n_units, group)
    n_cols = len(starts)
    columns = units.first_step[used][starts] if n_units else np.zeros(0, np.int64)
    col_steps = rollups.group_sum(units.n_steps[used], starts)
    bin_size = int(col_steps.max()) if n_cols else 1
    expected = np.maximum.reduceat(units.world_size[used], starts) if n_cols else np.zeros(0, np.int64)
    every_step = rollups.group_sum(units.present[:, used], starts) == col_steps
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
    z = stats.zscores(values, red.mean, red.std)
    robust = stats.robust_scores(values, red.p50, red.mad)
    score = robust if query.outlier_method == "modified_z" else z
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


def distributed_summary(
    store: SummaryStore,
    project: str,
    run_id: str,
    query: SummaryQuery,
    arrays: bool = False,
) -> Summary | None:
    """Read the run's window from the store and summarize it; None if it has no events.

    One path for any window: the level whose blocks give at least ``max_steps`` columns over the window
    (``level_size``; single steps for a short window) is read, finer blocks where the window's ends cut
    a block, and the steps after the rollups' progress mark (the newest, still filling up with ranks)
    event by event, at most ``raw_read_budget(store)`` of them. A column is a group of those units, exact for
    the steps it claims. The summary itself never writes.
    """
    progress = store.rollup_progress(project, run_id)
    low, high = query.step_min or 0, query.step_max
    rolled_high = progress.step if high is None else min(high, progress.step)
    events, through = [], None
    late = store.late_steps(project, run_id, low, rolled_high, LATE_STEPS_READ) if low <= rolled_high else []
    for a, b in _runs_of(late):  # rolled up before a late rank's events came: read as events
        events += store.read_events(project, run_id, a, b).events
    tail_low = max(low, progress.step + 1)
    if high is None or tail_low <= high:
        page = store.read_events(project, run_id, tail_low, high, raw_read_budget(store))
        events, through = events + page.events, page.complete_through
    first = store.next_step(project, run_id, low, rolled_high) if low <= rolled_high else None
    if first is None and not events:
        return None
    run = decode(events)
    span_first = first if first is not None else int(run.event_step.min())
    span_last = max(int(run.event_step.max()) if events else -1, rolled_high if first is not None else -1)
    tail_steps = np.unique(run.event_step)
    size = level_size(span_last - span_first + 1, query.max_steps)
    while True:  # a finer level while a coarser one merges steps into fewer than max_steps units
        headers = [] if first is None else _cover(store, project, run_id, first, rolled_high, size, late)
        unit_ids = {h.first_step // size for h in headers} | set((tail_steps // size).tolist())
        distinct = sum(h.n_steps for h in headers) + len(tail_steps)
        if size == 1 or len(unit_ids) >= query.max_steps or len(unit_ids) == distinct:
            break
        size //= 10
    all_keys = set(run.keys).union(*(h.keys for h in headers))
    keys = [k for k in (query.keys or sorted(all_keys)) if k in all_keys]
    pieces = _with_sums(store, project, run_id, headers, keys)
    if events:
        steps = tail_steps
        ws = int(run.event_world_size.max())
        step_units = units_from_run(run, steps, np.arange(len(steps)), len(steps), ws)
        counts = np.bincount(np.searchsorted(steps, run.event_step), minlength=len(steps))
        pieces += rollups.roll_steps(step_units, counts)
        nodes = step_units.node_start
    else:
        nodes = np.zeros(0, np.int64)
    stored_nodes = np.frombuffer(progress.nodes, "<i4").astype(np.int64)
    units = _units(pieces, size, keys, rollups.merge_nodes(stored_nodes, nodes))
    resolution: Resolution = {
        "unit": "step" if size == 1 else "level",
        "level_steps": size,
        "rollup_blocks_read": len(headers),
        "events_read": len(events),
        "late_steps_read": len(late),
        "complete_through_step": through,
    }
    summary = summarize_units(units, keys, project, run_id, query, resolution, arrays)
    if through is not None:
        summary["findings"].append(_partial_finding(through))
    return summary


def raw_read_budget(store: SummaryStore) -> int:
    """The most events a summary reads one by one from ``store``: ``RAW_READ_BUDGET``, or less where
    the store says its reads cost more (``raw_read_budget``: DynamoDB's items are parsed by botocore)."""
    return min(RAW_READ_BUDGET, getattr(store, "raw_read_budget", RAW_READ_BUDGET))


def level_size(span: int, max_steps: int) -> int:
    """The coarsest level whose blocks cut ``span`` steps into at least ``max_steps`` units (1: steps);
    with sparse steps the summary goes finer until its units are as many as it can have."""
    return max([s for s in rollups.LEVELS if span // s >= max_steps], default=1)


def _runs_of(steps: list[int]) -> list[tuple[int, int]]:
    """Ascending steps as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for step in steps:
        if runs and runs[-1][1] == step - 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


def _cover(
    store: SummaryStore, project: str, run_id: str, low: int, high: int, size: int, holes: list[int]
) -> list[rollups.BlockHeader]:
    """The rolled blocks that tile the steps ``low..high`` but ``holes`` (ascending steps read as
    events): blocks of ``size`` inside it, and where its ends or a hole cut a block, the finer blocks
    inside it (a block absent at one level has no events, so its parts are not looked for)."""
    chosen: list[rollups.BlockHeader] = []
    pending, start = [], low
    for a, b in _runs_of(holes):
        if start < a:
            pending.append((start, a - 1))
        start = b + 1
    if start <= high:
        pending.append((start, high))
    for level in reversed(rollups.LEVELS[: rollups.LEVELS.index(size) + 1]):
        finer = []
        for a, b in pending:
            for h in store.read_blocks(project, run_id, level, a // level, b // level):
                start, end = h.block * level, h.block * level + level - 1
                if a <= start and end <= b:
                    chosen.append(h)
                else:
                    finer.append((max(a, start), min(b, end)))
        pending = finer
    return chosen


def _with_sums(
    store: SummaryStore, project: str, run_id: str, headers: list[rollups.BlockHeader], keys: list[str]
) -> list[rollups.RolledBlock]:
    """The blocks with their sums of ``keys``, read per level and per run of consecutive blocks."""
    pieces = []
    by_level: dict[int, list[rollups.BlockHeader]] = {}
    for h in headers:
        by_level.setdefault(h.size, []).append(h)
    for size, group in by_level.items():
        group.sort(key=lambda h: h.block)
        runs: list[list[rollups.BlockHeader]] = []
        for h in group:
            if runs and h.block - runs[-1][-1].block <= 10:
                runs[-1].append(h)
            else:
                runs.append([h])
        for part in runs:
            sums = store.read_block_sums(project, run_id, size, keys, part[0].block, part[-1].block)
            for h in part:
                block_sums = {key: sums[key][h.block] for key in keys if h.block in sums[key]}
                pieces.append(rollups.RolledBlock(h, block_sums))
    return pieces


def _units(
    pieces: list[rollups.RolledBlock], size: int, keys: list[str], nodes: NDArray[np.int64]
) -> rollups.Units:
    """Units of ``size`` steps (one per block of that level holding events) from the pieces inside them."""
    by_unit: dict[int, list[rollups.RolledBlock]] = {}
    for piece in pieces:
        by_unit.setdefault(piece.header.first_step // size, []).append(piece)
    order = sorted(by_unit)
    blocks = [
        parts[0] if len(parts) == 1 else rollups.combine(size, unit, parts)
        for unit, parts in ((u, by_unit[u]) for u in order)
    ]
    n = len(blocks)
    heads = [b.header for b in blocks]
    ws = max([h.world_size for h in heads] + [len(nodes)], default=0)
    shape = (ws, n)
    fields = ("present", "first", "last", "lead", "span")
    if all(h.world_size == ws for h in heads) and n:  # one world size: whole arrays at once
        present, first, last, lead, span = (np.stack([getattr(h, f) for h in heads], axis=1) for f in fields)
    else:
        present, lead, span = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        first, last = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
        for u, h in enumerate(heads):
            w = h.world_size
            present[:w, u], first[:w, u], last[:w, u], lead[:w, u], span[:w, u] = (
                getattr(h, f) for f in fields
            )
    key_units = {key: _key_units([b.sums.get(key) for b in blocks], ws) for key in keys}
    world = np.array([h.world_size for h in heads], np.int64)
    steps = np.array([h.first_step for h in heads], np.int64)
    units = rollups.Units(
        first_step=steps,
        last_step=np.array([h.last_step for h in heads], np.int64),
        n_steps=np.array([h.n_steps for h in heads], np.int64),
        world_size=world,
        present=present,
        keys=key_units,
        rank_first=first,
        rank_last=last,
        node_start=np.concatenate([nodes, np.full(ws - len(nodes), -1, np.int64)]) if len(nodes) else nodes,
    )
    if size == 1:  # single steps: coverage is judged step by step
        units.raw_steps, units.raw_present, units.raw_world_size = steps, present > 0, world
    else:
        units.rolled = np.ones(n, bool)
        units.rank_lead, units.rank_span = lead, span
        units.raw_present = np.zeros((ws, 0), bool)
    return units


def _key_units(packed: list[bytes | None], ws: int) -> rollups.KeyUnits:
    """One key's sums (ranks x units) from each unit's packed sums (None: the key is not in it): one
    ``frombuffer`` when every unit holds all ``ws`` ranks, else unit by unit."""
    n = len(packed)
    size = rollups.KEY_UNIT_BYTES * ws
    if n and all(p is not None and len(p) == size for p in packed):
        raw = np.frombuffer(b"".join(packed), np.uint8).reshape(n, size)  # type: ignore[arg-type]

        def part(start: int, width: int, dtype: str) -> NDArray[Any]:
            return np.ascontiguousarray(raw[:, start * ws : (start + width) * ws]).view(dtype).T

        return rollups.KeyUnits(
            part(0, 8, "<f8").astype(np.float64),
            part(16, 4, "<u4").astype(np.int64),
            part(8, 8, "<f8").astype(np.float64),
            part(20, 4, "<u4").astype(np.int64),
        )
    shape = (ws, n)
    k = rollups.KeyUnits(
        np.zeros(shape), np.zeros(shape, np.int64), np.zeros(shape), np.zeros(shape, np.int64)
    )
    for u, one in enumerate(packed):
        if one is not None:
            k.total[:, u], k.count[:, u], k.weight[:, u], k.nonfinite[:, u] = rollups.unpack_key_units(
                one, ws
            )
    return k


def _partial_finding(through: int) -> Finding:
    return {
        "kind": "partial",
        "rank": None,
        "key": None,
        "step": through,
        "severity": "info",
        "message": f"this summary covers the run through step {through}: the rest has too many events "
        "not rolled up yet to read at once; it is being rolled up in the background, reload to see more",
    }
