"""The Distributed summary of one run (contract 5): read the run's events, decode, reduce, explain."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shared import findings as explain
from shared import stats
from shared.models import FieldError, InvalidInput
from shared.store import MetricsStore, StoredEvent

DEFAULT_MAX_STEPS = 200
MAX_MAX_STEPS = 5000
DEFAULT_OUTLIER_LIMIT = 100
MAX_OUTLIER_LIMIT = 10000
#: ``outlier_method``: how ``score`` is computed for each value against the other ranks at its column.
#: ``modified_z`` (default): 0.6745 * (x - median) / MAD, MeanAD fallback when MAD is 0 (stats.robust_scores).
#: ``z``: the plain z-score (x - mean) / std, which cannot exceed sqrt(n - 1) among n ranks.
OUTLIER_METHODS = ("modified_z", "z")


@dataclass(frozen=True)
class SummaryQuery:
    """The summary's query parameters (contract 5), already parsed."""

    keys: tuple[str, ...] | None = None
    step_min: int | None = None
    step_max: int | None = None
    max_steps: int = DEFAULT_MAX_STEPS
    outlier_method: str = "modified_z"
    outlier_threshold: float = stats.DEFAULT_OUTLIER_THRESHOLD
    outlier_limit: int = DEFAULT_OUTLIER_LIMIT


def parse_query(params: dict[str, str]) -> SummaryQuery:
    """Query string parameters to a :class:`SummaryQuery`; a bad one raises ``InvalidInput``."""
    known = {"keys", "step_min", "step_max", "max_steps"} | {
        "outlier_method",
        "outlier_threshold",
        "outlier_limit",
    }
    errors = [FieldError(name, "is not a known parameter") for name in params if name not in known]

    def integer(name: str, low: int, high: int) -> int | None:
        raw = params.get(name)
        if raw is None or raw == "":
            return None
        if not raw.isdigit() or not low <= int(raw) <= high:
            errors.append(FieldError(name, f"must be an integer from {low} to {high}, got {raw!r}"))
            return None
        return int(raw)

    step_min = integer("step_min", 0, 2**53 - 1)
    step_max = integer("step_max", 0, 2**53 - 1)
    max_steps = integer("max_steps", 1, MAX_MAX_STEPS)
    outlier_limit = integer("outlier_limit", 0, MAX_OUTLIER_LIMIT)
    method = params.get("outlier_method") or "modified_z"
    if method not in OUTLIER_METHODS:
        choices = ", ".join(OUTLIER_METHODS)
        errors.append(FieldError("outlier_method", f"must be one of {choices}, got {method!r}"))
    threshold = stats.DEFAULT_OUTLIER_THRESHOLD
    if params.get("outlier_threshold"):
        try:
            threshold = float(params["outlier_threshold"])
            if not 0 < threshold < 1e6:
                raise ValueError
        except ValueError:
            errors.append(FieldError("outlier_threshold", "must be a positive number below 1e6"))
    if step_min is not None and step_max is not None and step_min > step_max:
        errors.append(FieldError("step_min", "must not be greater than step_max"))
    keys = tuple(k for k in params["keys"].split(",") if k) if params.get("keys") else None
    if errors:
        raise InvalidInput(f"{errors[0].field} {errors[0].message}", errors)
    return SummaryQuery(
        keys=keys,
        step_min=step_min,
        step_max=step_max,
        max_steps=max_steps or DEFAULT_MAX_STEPS,
        outlier_method=method,
        outlier_threshold=threshold,
        outlier_limit=DEFAULT_OUTLIER_LIMIT if outlier_limit is None else outlier_limit,
    )


@dataclass
class DecodedRun:
    """A run's values flattened to one entry per (event, key), newest event per (key, step, rank)."""

    keys: list[str]
    key_id: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    step: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    rank: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    value: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    weight: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    # per event, for coverage:
    event_step: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    event_rank: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    event_world_size: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))


def decode(events: list[StoredEvent]) -> DecodedRun:
    """Stored items to flat arrays: one ``frombuffer`` per item, no Python work per value.

    When two events carry the same (step, rank, key), the later ``time`` wins, ties to the larger
    event id (contract 6).
    """
    key_index: dict[str, int] = {}
    key_ids_of: dict[str, NDArray[np.int64]] = {}  # the joined key list of an item -> key ids
    ids, packed = [], []
    for event in events:
        joined = "\n".join(event.keys)
        ids_for_item = key_ids_of.get(joined)
        if ids_for_item is None:
            ids_for_item = np.array([key_index.setdefault(k, len(key_index)) for k in event.keys], np.int64)
            key_ids_of[joined] = ids_for_item
        ids.append(ids_for_item)
        packed.append(np.frombuffer(event.packed, "<f8"))
    keys = list(key_index)
    if not events:
        return DecodedRun(keys)
    n_values = np.array([len(i) for i in ids], np.int64)
    event_step = np.array([e.step for e in events], np.int64)
    event_rank = np.array([e.rank for e in events], np.int64)
    event_ws = np.array([e.world_size for e in events], np.int64)
    heads = np.array([p[:2] for p in packed])  # weight, time per event
    values = np.concatenate([p[2:] for p in packed])
    key_id = np.concatenate(ids)
    step = np.repeat(event_step, n_values)
    rank = np.repeat(event_rank, n_values)
    weight = np.repeat(heads[:, 0], n_values)
    time = np.repeat(heads[:, 1], n_values)
    _, id_order = np.unique(np.array([e.event_id for e in events]), return_inverse=True)
    event_order = np.repeat(id_order, n_values)
    # Sort so that within each (key, step, rank) group the winner comes last, then keep the last.
    order = np.lexsort((event_order, time, rank, step, key_id))
    k, s, r = key_id[order], step[order], rank[order]
    last = np.ones(len(order), bool)
    last[:-1] = (k[1:] != k[:-1]) | (s[1:] != s[:-1]) | (r[1:] != r[:-1])
    keep = order[last]
    return DecodedRun(
        keys=keys,
        key_id=key_id[keep],
        step=step[keep],
        rank=rank[keep],
        value=values[keep],
        weight=weight[keep],
        event_step=event_step,
        event_rank=event_rank,
        event_world_size=event_ws,
    )


def _json_list(array: NDArray[Any]) -> list[Any]:
    """A numpy vector or matrix as JSON lists, ``null`` for NaN or Infinity."""
    if array.dtype.kind in "iub":
        return array.tolist()  # type: ignore[no-any-return]
    out = array.astype(object)
    out[~np.isfinite(array)] = None
    return out.tolist()  # type: ignore[no-any-return]


def summarize(run: DecodedRun, project: str, run_id: str, query: SummaryQuery) -> dict[str, Any]:
    """The contract 5.1 document for a decoded run."""
    steps_all = np.unique(run.event_step)
    if query.step_min is not None:
        steps_all = steps_all[steps_all >= query.step_min]
    if query.step_max is not None:
        steps_all = steps_all[steps_all <= query.step_max]
    n_steps = len(steps_all)
    bin_size = max(1, -(-n_steps // query.max_steps))
    world_size = int(run.event_world_size.max()) if len(run.event_world_size) else 0
    ranks = np.arange(world_size)
    keys = [k for k in (query.keys or sorted(run.keys)) if k in run.keys]
    n_cols = -(-n_steps // bin_size)
    columns = steps_all[::bin_size]

    # Coverage: which ranks sent any event at each step, and the largest world size per step.
    in_window = np.isin(run.event_step, steps_all)
    col_of_event = np.searchsorted(steps_all, run.event_step[in_window])
    present = np.zeros((world_size, n_steps), bool)
    present[run.event_rank[in_window], col_of_event] = True
    step_ws = np.zeros(n_steps, np.int64)
    np.maximum.at(step_ws, col_of_event, run.event_world_size[in_window])
    expected = np.zeros(n_cols, np.int64)
    np.maximum.at(expected, np.arange(n_steps) // bin_size, step_ws)
    every_step = stats.column_all(present, bin_size)
    below_expected = ranks[:, None] < expected[None, :]
    reported = (every_step & below_expected).sum(axis=0)
    missing = [ranks[below_expected[:, c] & ~every_step[:, c]].tolist() for c in range(n_cols)]

    reducers: dict[str, Any] = {}
    heatmap: dict[str, Any] = {}
    outliers: list[dict[str, Any]] = []
    findings = explain.coverage_findings(present, step_ws, steps_all)
    rank_keys: dict[int, dict[str, Any]] = {int(r): {} for r in ranks}
    step_in_window = np.isin(run.step, steps_all)
    for key in keys:
        kid = run.keys.index(key)
        sel = (run.key_id == kid) & step_in_window
        rows, cols = run.rank[sel], np.searchsorted(steps_all, run.step[sel])
        raw = np.full((world_size, n_steps), np.nan)
        raw[rows, cols] = run.value[sel]
        weights = np.zeros((world_size, n_steps))
        weights[rows, cols] = run.weight[sel]
        finite_at = np.zeros((world_size, n_steps), bool)
        finite_at[rows, cols] = np.isfinite(run.value[sel])
        nonfinite_at = np.zeros((world_size, n_steps), bool)
        nonfinite_at[rows, cols] = ~finite_at[rows, cols]
        raw[nonfinite_at] = np.nan
        values, col_weights = stats.bin_columns(raw, weights, bin_size)
        nonfinite = stats.column_any(nonfinite_at, bin_size)
        # Cells built from every step of the column: only those can be compared value for value.
        complete = stats.column_all(finite_at | ~present, bin_size) & every_step
        red = stats.reducers(values, col_weights)
        reducers[key] = {
            name: _json_list(getattr(red, name))
            for name in ("count", "mean", "weighted_mean", "min", "max", "range", "std", "p05", "p50", "p95")
        }
        reducers[key]["nonfinite"] = nonfinite.sum(axis=0).tolist()
        z = stats.zscores(values, red.mean, red.std)
        heatmap[key] = {"values": _json_list(values), "z": _json_list(z)}
        robust = stats.robust_scores(values, red.p50)
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
        noise = stats.rank_noise(values, red.p50)
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
        findings += explain.key_findings(
            key, values, col_weights, red, robust, noise, nonfinite, complete, columns, bin_size
        )
    outliers.sort(key=lambda row: -abs(row["score"]))
    severity_order = {"critical": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: severity_order[f["severity"]])

    rank_stats = []
    last_step = int(steps_all[-1]) if n_steps else None
    for r in ranks:
        seen = np.nonzero(present[r])[0]
        rank_stats.append(
            {
                "rank": int(r),
                "steps_reported": len(seen),
                "first_step": int(steps_all[seen[0]]) if len(seen) else None,
                "last_step": int(steps_all[seen[-1]]) if len(seen) else None,
                "keys": rank_keys[int(r)],
            }
        )
    return {
        "project": project,
        "run_id": run_id,
        "keys": keys,
        "world_size": world_size,
        "ranks": ranks.tolist(),
        "step_min": int(steps_all[0]) if n_steps else query.step_min,
        "step_max": last_step if n_steps else query.step_max,
        "bin_size": bin_size,
        "steps": columns.tolist(),
        "reducers": reducers,
        "coverage": {"expected": expected.tolist(), "reported": reported.tolist(), "missing": missing},
        "heatmap": heatmap,
        "outliers": outliers[: query.outlier_limit],
        "rank_stats": rank_stats,
        "findings": findings,
    }


def distributed_summary(
    store: MetricsStore, project: str, run_id: str, query: SummaryQuery
) -> dict[str, Any] | None:
    """Read the run's events in the window from the store and summarize them; None if there are none."""
    events = store.query_run(project, run_id, query.step_min or 0, query.step_max)
    if not events:
        return None
    return summarize(decode(events), project, run_id, query)
