"""Runs to compare, stored through the real HTTP API of a local stack: the compare page's tests
(tests/stack/test_runs_pages.py), its benchmark (``benchmarks/runs_page.py --compare``) and the README's
screenshots seed the same data.

Each run is ``tests/synthetic.py``'s job (``train/loss``, ``optimizer/grad_norm``, ``system/step_time``
per rank with uneven weights), its faults picked per run, sent through the rank-metrics batch route
(1,000 events a request, 4 requests at once); rank 0's ``train/loss`` and a learning rate go through the
scalars batch route as ``run.log`` would; each run gets a config that differs from the others' in a few
settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from instantml import routes
from instantml.limits import MAX_BATCH_EVENTS
from tests.faults import call
from tests.synthetic import synthetic_matrices

KEYS = ("train/loss", "optimizer/grad_norm", "system/step_time")


def _post(stack: Any, route: str, project: str, run_id: str, events: list[dict[str, Any]]) -> None:
    status, answer = call(stack, "POST", route.format(project=project, run_id=run_id), {"events": events})
    assert status == 200, (status, answer)
    assert answer.get("rejected", 0) == 0, (status, answer)


def rank_events(
    run_id: str, ranks: int, steps: int, faults: tuple[str, ...], seed: int
) -> Iterator[dict[str, Any]]:
    values, weights, present = synthetic_matrices(ranks, steps, faults, seed)
    for s in range(steps):
        for r in range(ranks):
            if present[r, s]:
                metrics = {k: _wire(values[r, s, i]) for i, k in enumerate(KEYS)}
                yield {
                    "event_id": f"{run_id}-{s}-{r}",
                    "step": s,
                    "rank": r,
                    "world_size": ranks,
                    "weight": float(weights[r, s]),
                    "metrics": metrics,
                }


def _wire(v: float) -> float | str:
    return float(v) if math.isfinite(v) else "NaN"


def seed_run(
    stack: Any,
    project: str,
    run_id: str,
    ranks: int,
    steps: int,
    faults: tuple[str, ...] = (),
    seed: int = 0,
    config: dict[str, Any] | None = None,
    finished: bool = True,
) -> None:
    events = list(rank_events(run_id, ranks, steps, faults, seed))
    batches = [events[i : i + MAX_BATCH_EVENTS] for i in range(0, len(events), MAX_BATCH_EVENTS)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda b: _post(stack, routes.RANK_METRICS_BATCH, project, run_id, b), batches))
    rng = np.random.default_rng(seed)
    lr = config.get("lr", 3e-4) if config else 3e-4
    scalars = [
        {
            "event_id": f"s-{s}",
            "step": s,
            "rank": 0,
            "metrics": {
                "lr": lr * min(1.0, (s + 1) / (steps / 10)),
                "val/loss": 2.5 * math.exp(-s / (steps / 4)) + 0.25 + float(rng.normal(0, 0.01)),
            },
        }
        for s in range(0, steps, max(1, steps // 200))
    ]
    _post(stack, routes.SCALARS_BATCH, project, run_id, scalars)
    body: dict[str, Any] = {"config": config or {}}
    if finished:
        body["status"] = "finished"
    status, answer = call(stack, "PATCH", routes.RUN.format(project=project, run_id=run_id), body)
    assert status == 200, (status, answer)


#: The runs of a comparison: (run id suffix, faults, config changes).
VARIANTS: tuple[tuple[str, tuple[str, ...], dict[str, Any]], ...] = (
    ("baseline", (), {}),
    ("slow-node", ("slow",), {"nodes": 9}),
    ("lr-x2", ("spikes",), {"lr": 6e-4}),
    ("bad-shard", ("spikes", "stop"), {"data": {"shards": 64, "seed": 7}}),
)


def seed_comparison(stack: Any, project: str, runs: int, ranks: int, steps: int) -> list[str]:
    """``runs`` runs of ``ranks`` x ``steps`` (VARIANTS in turn); their ids."""
    ids = []
    for i in range(runs):
        name, faults, changes = VARIANTS[i % len(VARIANTS)]
        run_id = f"{name}-{i}" if i >= len(VARIANTS) else name
        config: dict[str, Any] = {
            "model": "gpt2-small",
            "lr": 3e-4,
            "batch_size": 32,
            "nodes": 8,
            "data": {"shards": 64, "seed": 1},
        }
        config.update(changes)
        seed_run(stack, project, run_id, ranks, steps, faults, seed=i, config=config)
        ids.append(run_id)
    return ids
