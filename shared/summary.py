"""The Distributed summary of one run (contract 5): read the run's events through the store port
(``distributed_summary``), decode them (``shared.decoding``), reduce (``shared.stats``), explain
(``shared.findings``) and lay out the document. The query is parsed by ``shared.query``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from instantml import limits
from shared import findings as explain
from shared import rollups, stats
from shared.decoding import DecodedRun, decode, units_from_run
from shared.query import SummaryQuery
from shared.store.port import SummaryStore

#: Up to this many events in rolled-up blocks, a window is read event by event (exact per step).
RAW_EVENT_BUDGET = 200_000
#: At most about this many events are read per summary (a Lambda reads some 10^5 items/s); a window
#: with more events outside rolled-up blocks is summarized up to where the reading stopped.
RAW_READ_BUDGET = 400_000
MAX_BLOCK = limits.MAX_STEP // rollups.BLOCK_STEPS
HEATMAP_Z_DECIMALS = 3
#: The reducers of contract 5.2, in the document's order (``nonfinite`` follows them).
STATISTICS = ("count", "mean", "weighted_mean", "min", "max", "range", "std", "p05", "p50", "p95")


def _json_list(array: NDArray[Any]) -> list[Any]:
    """A numpy vector or matrix as JSON lists, ``null`` for NaN or Infinity."""
    if array.dtype.kind in "iub":
        return array.tolist()  # type: ignore[no-any-return]
    out = array.astype(object)
    out[~np.isfinite(array)] = None
    return out.tolist()  # type: ignore[no-any-return]


def summarize(
    run: DecodedRun, project: str, run_id: str, query: SummaryQuery, arrays: bool = False
) -> dict[str, Any]:
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
    extra: dict[str, Any] | None = None,
    arrays: bool = False,
) -> dict[str, Any]:
    """The contract 5.1 document from units, grouped into at most ``query.max_steps`` columns; with
    ``arrays``, ``heatmap[key]`` holds numpy matrices (``values``, ``z``) for ``shared.wire``."""
    used = np.nonzero(units.n_steps > 0)[0]
    n_units = len(used)
    group = max(1, -(-n_units // query.max_steps))
    starts = np.arange(0, n_units, group)
    world_size, n_cols = units.present.shape[0], len(starts)
    ranks = np.arange(world_size)
    columns = units.first_step[used][starts] if n_units else np.zeros(0, np.int64)
    col_steps = rollups.group_sum(units.n_steps[used], starts)
    bin_size = int(col_steps.max()) if n_cols else 1
    expected = np.maximum.reduceat(units.world_size[used], starts) if n_cols else np.zeros(0, np.int64)
    every_step = rollups.group_sum(units.present[:, used], starts) == col_steps
    below_expected = ranks[:, None] < expected[None, :]
    reported = (every_step & below_expected).sum(axis=0)
    missing = [ranks[below_expected[:, c] & ~every_step[:, c]].tolist() for c in range(n_cols)]

    # Each rank's first and last step over every unit (-1: never).
    big = np.iinfo(np.int64).max
    first_seen = np.where(units.rank_first >= 0, units.rank_first, big).min(axis=1, initial=big)
    first_seen[first_seen == big] = -1
    last_seen = units.rank_last.max(axis=1, initial=-1)
    run_last = int(units.last_step[used].max()) if n_units else None

    reducers: dict[str, Any] = {}
    heatmap: dict[str, Any] = {}
    outliers: list[dict[str, Any]] = []
    findings = explain.coverage_findings(
        units.raw_present,
        units.raw_world_size,
        units.raw_steps,
        last_seen,
        first_seen,
        run_last,
        _rolled_coverage(units, first_seen, last_seen),
    )
    rank_keys: dict[int, dict[str, Any]] = {int(r): {} for r in ranks}
    results: dict[str, explain.KeyResult] = {}
    column_of = {int(step): c for c, step in enumerate(columns.tolist())}
    for key in keys:
        k = units.keys[key]
        count = rollups.group_sum(k.count[:, used], starts)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = np.where(count > 0, rollups.group_sum(k.total[:, used], starts) / count, np.nan)
        col_weights = rollups.group_sum(k.weight[:, used], starts)
        nonfinite = rollups.group_sum(k.nonfinite[:, used], starts) > 0
        # Cells built from every step of the column: only those can be compared value for value.
        complete = every_step & (count == col_steps)
        red = stats.reducers(values, col_weights)
        reducers[key] = {name: _json_list(getattr(red, name)) for name in STATISTICS}
        reducers[key]["nonfinite"] = nonfinite.sum(axis=0).tolist()
        z = stats.zscores(values, red.mean, red.std)
        # z to 3 decimals: it only colours cells, and full digits would double a 512-rank response.
        heatmap[key] = {"values": values, "z": np.round(z, HEATMAP_Z_DECIMALS)}
        robust = stats.robust_scores(values, red.p50, red.mad)
        score = robust if query.outlier_method == "modified_z" else z
        flagged = np.abs(np.nan_to_num(score)) >= query.outlier_threshold
        for r, c in zip(*np.nonzero(flagged), strict=True):
            outliers.append(
                {
                    "key": key,
                    "step": int(columns[c]),
                    "rank": int(r),
                    "value": float(values[r, c]),
                    "mean": float(red.mean[c]),
                    "delta": float(values[r, c] - red.mean[c]),
                    "z": float(z[r, c]),
                    "score": float(score[r, c]),
                }
            )
        result = explain.key_findings(key, values, col_weights, red, nonfinite, complete, columns, bin_size)
        findings += result.findings
        results[key] = result
        noise = result.noise
        with np.errstate(all="ignore"):
            has_z = ~np.isnan(z)
            n_z = has_z.sum(axis=1)
            mean_z = np.where(has_z, z, 0.0).sum(axis=1) / n_z
        for r in ranks:
            rank_keys[int(r)][key] = {
                "mean_z": float(mean_z[r]) if n_z[r] else None,
                "noise": float(noise[r]) if np.isfinite(noise[r]) else None,
                "outlier_steps": int(flagged[r].sum()),
            }
    findings = explain.cross_key_findings(findings, results, units.node_start)
    for row in outliers:  # an alarm where a warning or critical finding stands behind the cell
        alarm = results[row["key"]].alarm
        row["alarm"] = bool(alarm is not None and alarm[row["rank"], column_of[row["step"]]])
    outliers.sort(key=lambda row: -abs(row["score"]))
    per_key: dict[str, int] = {}
    capped = []
    for row in outliers:  # the cap holds per key: the tab shows one key at a time
        if per_key.get(row["key"], 0) < query.outlier_limit:
            per_key[row["key"]] = per_key.get(row["key"], 0) + 1
            capped.append(row)
    severity_order = {"critical": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: severity_order[f["severity"]])

    steps_reported = units.present.sum(axis=1)
    rank_stats = [
        {
            "rank": int(r),
            "steps_reported": int(steps_reported[r]),
            "first_step": int(first_seen[r]) if last_seen[r] >= 0 else None,
            "last_step": int(last_seen[r]) if last_seen[r] >= 0 else None,
            "keys": rank_keys[int(r)],
        }
        for r in ranks
    ]
    summary = {
        "project": project,
        "run_id": run_id,
        "keys": keys,
        "world_size": world_size,
        "ranks": ranks.tolist(),
        "step_min": int(units.first_step[used].min()) if n_units else query.step_min,
        "step_max": run_last if n_units else query.step_max,
        "bin_size": bin_size,
        "steps": columns.tolist(),
        "reducers": reducers,
        "coverage": {"expected": expected.tolist(), "reported": reported.tolist(), "missing": missing},
        "heatmap": heatmap,
        "outliers": capped,
        "rank_stats": rank_stats,
        "findings": findings,
    }
    if extra:
        summary.update(extra)
    if not arrays:
        summary["heatmap"] = heatmap_lists(heatmap)
    return summary


def heatmap_lists(heatmap: dict[str, dict[str, NDArray[np.float64]]]) -> dict[str, Any]:
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
    raw_event_budget: int | None = None,
    arrays: bool = False,
) -> dict[str, Any] | None:
    """Read the run's window from the store and summarize it; None if it has no events.

    While the rolled-up blocks in the window hold at most ``raw_event_budget`` events (default
    ``RAW_EVENT_BUDGET``), every event is read and the summary is exact per step. Beyond that, rolled-up
    blocks come from their rollups (``shared.rolling`` keeps them, in the background) and only the rest
    of the window (the blocks
    being written, blocks not rolled up yet, partial blocks at the window's ends) is read event by
    event; columns are then whole blocks. The summary itself never writes.
    """
    low = query.step_min or 0
    high = query.step_max
    first_block = -(-low // rollups.BLOCK_STEPS)
    last_block = MAX_BLOCK if high is None else (high + 1) // rollups.BLOCK_STEPS - 1
    headers = store.read_blocks(project, run_id, first_block, last_block) if first_block <= last_block else []
    budget = RAW_EVENT_BUDGET if raw_event_budget is None else raw_event_budget
    if sum(h.n_events for h in headers) <= budget:
        page = store.read_events(project, run_id, low, high, RAW_READ_BUDGET)
        events, through = page.events, page.complete_through
        if not events:
            return None
        run = decode(events)
        read_high = high if through is None else through
        summary = summarize(run, project, run_id, replace(query, step_max=read_high), arrays)
        summary["resolution"] = _resolution("step", 0, len(events), through)
        if through is not None:
            summary["findings"].append(_partial_finding(through))
        return summary

    # Block mode: raw events only outside the rolled-up blocks, within the read budget.
    events, through = [], None
    for lo, hi in _raw_intervals(low, high, [h.block for h in headers]):
        page = store.read_events(project, run_id, lo, hi, RAW_READ_BUDGET - len(events))
        events += page.events
        through = page.complete_through
        if through is not None:
            break
    if through is not None:  # what lies beyond was not read: leave it out, rolled up or not
        headers = [h for h in headers if h.last_step <= through]
    run = decode(events)
    if not headers:  # the reading stopped before the first rolled-up block
        summary = summarize(run, project, run_id, replace(query, step_max=through), arrays)
        summary["resolution"] = _resolution("step", 0, len(events), through)
        summary["findings"].append(_partial_finding(through if through is not None else low))
        return summary
    raw_steps = _window_steps(run, replace(query, step_max=high if through is None else through))
    # One unit per block that holds events (never one per block number between them: steps may be
    # as sparse as a tokens-seen counter).
    raw_blocks = raw_steps // rollups.BLOCK_STEPS
    blocks = np.union1d(np.array([h.block for h in headers], np.int64), raw_blocks)
    n_units = len(blocks)
    world_size = max([h.world_size for h in headers] + [int(run.event_world_size.max(initial=0))])
    units = units_from_run(run, raw_steps, np.searchsorted(blocks, raw_blocks), n_units, world_size)
    all_keys = set(run.keys).union(*(h.keys for h in headers))
    keys = [k for k in (query.keys or sorted(all_keys)) if k in all_keys]
    sums = store.read_block_sums(project, run_id, keys, headers[0].block, headers[-1].block)
    shape = (world_size, n_units)
    for key in keys:
        if key not in units.keys:
            units.keys[key] = rollups.KeyUnits(
                np.zeros(shape), np.zeros(shape, np.int64), np.zeros(shape), np.zeros(shape, np.int64)
            )
    units.rolled = np.zeros(n_units, bool)
    units.rank_lead, units.rank_span = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    for h in headers:
        u = int(np.searchsorted(blocks, h.block))
        units.rolled[u] = True
        units.first_step[u], units.last_step[u] = h.first_step, h.last_step
        units.n_steps[u], units.world_size[u] = h.n_steps, h.world_size
        ws = h.world_size
        units.present[:ws, u], units.rank_first[:ws, u], units.rank_last[:ws, u] = h.present, h.first, h.last
        units.rank_lead[:ws, u], units.rank_span[:ws, u] = h.lead, h.span
        for key in keys:
            packed = sums[key].get(h.block)
            if packed is not None:
                k = units.keys[key]
                k.total[:, u], k.count[:, u], k.weight[:, u], k.nonfinite[:, u] = rollups.unpack_key_units(
                    packed, world_size
                )
    extra = {"resolution": _resolution("block", len(headers), len(events), through)}
    summary = summarize_units(units, keys, project, run_id, query, extra, arrays)
    if through is not None:
        summary["findings"].append(_partial_finding(through))
    return summary


def _partial_finding(through: int) -> dict[str, Any]:
    return {
        "kind": "partial",
        "rank": None,
        "key": None,
        "step": through,
        "severity": "info",
        "message": f"this summary covers the run through step {through}: the rest has too many events "
        "not rolled up yet to read at once; it is being rolled up in the background, reload to see more",
    }


def _resolution(unit: str, blocks: int, events: int, through: int | None) -> dict[str, Any]:
    """What the summary was computed from (an addition to contract 5.1)."""
    return {
        "unit": unit,
        "block_steps": rollups.BLOCK_STEPS,
        "rollup_blocks_read": blocks,
        "events_read": events,
        "complete_through_step": through,
    }


def _raw_intervals(low: int, high: int | None, rolled: list[int]) -> list[tuple[int, int | None]]:
    """The step ranges of the window ``[low, high]`` outside the rolled-up blocks (sorted numbers)."""
    intervals: list[tuple[int, int | None]] = []
    start = low
    for block in rolled:
        block_low, block_high = block * rollups.BLOCK_STEPS, (block + 1) * rollups.BLOCK_STEPS - 1
        if block_low > start:
            intervals.append((start, block_low - 1))
        start = block_high + 1
    if high is None or start <= high:
        intervals.append((start, high))
    return intervals
