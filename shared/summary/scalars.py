"""``run.log`` scalars read back: each (key, rank) series of a run, binned into at most ``max_steps``
points as the summary bins its columns. The binning is a pure numpy function; ``scalar_series`` reads
through the store port."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from instantml import limits
from shared.errors import NotFound
from shared.store.port import ScalarsReadStore
from shared.summary.decoding import decode
from shared.summary.query import DEFAULT_MAX_STEPS, MAX_MAX_STEPS, WINDOW_PARAMETERS, Params

#: Scalar events read for one answer at most; a longer window is cut at a whole step (``complete_through``).
READ_BUDGET = 500_000


@dataclass(frozen=True)
class ScalarsQuery:
    keys: tuple[str, ...] | None = None
    step_min: int = 0
    step_max: int | None = None
    max_steps: int = DEFAULT_MAX_STEPS


def parse_query(params: dict[str, str]) -> ScalarsQuery:
    """``keys``, ``step_min``, ``step_max``, ``max_steps``; a bad one raises ``InvalidInput``."""
    query = Params(params, WINDOW_PARAMETERS)
    step_min, step_max = query.window()
    max_steps = query.integer("max_steps", 1, MAX_MAX_STEPS) or DEFAULT_MAX_STEPS
    query.check()
    return ScalarsQuery(query.keys(), step_min or 0, step_max, max_steps)


def bin_series(steps: NDArray[np.int64], values: NDArray[np.float64], max_steps: int) -> dict[str, Any]:
    """One series (steps ascending, one value each) in bins of ``ceil(n / max_steps)`` points: per bin
    its last step, the mean, min and max of its finite values (None when it has none) and its last value
    (NaN and Infinity as the contract's strings)."""
    n = len(steps)
    size = max(1, -(-n // max_steps))
    starts = np.arange(0, n, size)
    ends = np.minimum(starts + size, n) - 1
    finite = np.isfinite(values)
    count = np.add.reduceat(finite.astype(np.int64), starts)
    total = np.add.reduceat(np.where(finite, values, 0.0), starts)
    low = np.minimum.reduceat(np.where(finite, values, np.inf), starts)
    high = np.maximum.reduceat(np.where(finite, values, -np.inf), starts)
    none = count == 0

    def listed(array: NDArray[np.float64]) -> list[float | None]:
        out: list[float | None] = array.tolist()
        for i in np.flatnonzero(none).tolist():
            out[i] = None
        return out

    return {
        "points": n,
        "bin": size,
        "steps": steps[ends].tolist(),
        "mean": listed(total / np.maximum(count, 1)),
        "min": listed(low),
        "max": listed(high),
        "last": [limits.wire_value(v) for v in values[ends].tolist()],
    }


def scalar_series(store: ScalarsReadStore, project: str, run_id: str, query: ScalarsQuery) -> dict[str, Any]:
    """``GET .../scalars``: the run's series; ``NotFound`` when the run is unknown."""
    page = store.read_scalars(project, run_id, query.step_min, query.step_max, READ_BUDGET)
    if not page.events and store.get_run(project, run_id) is None:
        raise NotFound(f"project {project!r} has no run {run_id!r}")
    run = decode(page.events)  # one value per (key, step, rank): the later time wins
    wanted = set(run.keys) if query.keys is None else set(query.keys)
    series = []
    by_name = sorted((key, i) for i, key in enumerate(run.keys) if key in wanted)
    # decode sorts values by key, step and rank: a key is one slice, and a rank's steps ascend in it.
    bounds = np.searchsorted(run.key_id, np.arange(len(run.keys) + 1))
    for key, key_id in by_name:
        of_key = slice(bounds[key_id], bounds[key_id + 1])
        ranks, steps, values = run.rank[of_key], run.step[of_key], run.value[of_key]
        for rank in np.unique(ranks).tolist():
            mine = ranks == rank
            series.append(
                {"key": key, "rank": rank, **bin_series(steps[mine], values[mine], query.max_steps)}
            )
    return {
        "project": project,
        "run_id": run_id,
        "keys": sorted(run.keys),
        "series": series,
        "complete_through": page.complete_through,
    }
