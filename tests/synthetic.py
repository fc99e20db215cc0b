"""A synthetic distributed job for tests and benchmarks: clean, or with faults injected on chosen ranks.

The clean job is what a healthy data-parallel run looks like: ``train/loss`` decays with independent
noise per rank (and a tiny per-rank offset), ``optimizer/grad_norm`` is all-reduced (bit-identical on
every rank), ``system/step_time`` has a small per-rank offset and noise, and the weights (batch sizes)
are uneven but unrelated to the values. Each fault changes one rank, so a test can say which finding
(kind, rank, key) it must produce.
"""

from __future__ import annotations

import numpy as np

from shared.store.port import StoredEvent

LOSS, GRAD, STEP_TIME = "train/loss", "optimizer/grad_norm", "system/step_time"
KEYS = (LOSS, GRAD, STEP_TIME)
LOSS_NOISE = 0.02

#: fault -> (rank it is injected on, the finding it must produce: kind, key)
FAULTS: dict[str, tuple[int, str, str | None]] = {
    "disagree": (0, "rank_disagreement", GRAD),
    "stop": (1, "stopped_reporting", None),
    "gaps": (2, "missing_steps", None),
    "slow": (3, "persistent_outlier", STEP_TIME),
    "noisy": (4, "noisy_rank", LOSS),
    "spikes": (5, "spike", LOSS),
    "nan": (6, "nonfinite", LOSS),
    "weights": (7, "weighted_differs", LOSS),
}


def synthetic_job(
    ranks: int, steps: int, faults: tuple[str, ...] = (), seed: int = 0, keys: int = 3
) -> list[StoredEvent]:
    """The stored events of one job, as ``read_events`` would return them."""
    values, weights, present = synthetic_matrices(ranks, steps, faults, seed)
    values = values[:, :, :keys]
    times = np.arange(steps)[None, :] + np.arange(ranks)[:, None] * 1e-3
    packed = np.concatenate([weights[:, :, None], times[:, :, None], values], axis=2).astype("<f8")
    names = list(KEYS[:keys])
    events = []
    for r, s in zip(*np.nonzero(present), strict=True):
        events.append(StoredEvent(f"e-{r}-{s}", int(s), int(r), ranks, names, packed[r, s].tobytes()))
    return events


def synthetic_matrices(
    ranks: int, steps: int, faults: tuple[str, ...] = (), seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``values`` (ranks x steps x 3 keys), ``weights`` and ``present`` (ranks x steps)."""
    unknown = set(faults) - set(FAULTS)
    assert not unknown, unknown
    rng = np.random.default_rng(seed)
    step = np.arange(steps)
    loss = (
        2.4 * np.exp(-step / 60)[None, :]
        + 0.2
        + rng.normal(0, 0.002, (ranks, 1))
        + rng.normal(0, LOSS_NOISE, (ranks, steps))
    )
    grad = np.broadcast_to(3.0 + rng.normal(0, 0.3, steps), (ranks, steps)).copy()
    step_time = 0.25 * (1 + rng.normal(0, 0.005, (ranks, 1))) + rng.normal(0, 0.005, (ranks, steps))
    weights = rng.integers(900, 1100, (ranks, steps)).astype(float)
    present = np.ones((ranks, steps), bool)

    def rank_of(fault: str) -> int:
        return FAULTS[fault][0]

    if "disagree" in faults:
        grad[rank_of("disagree"), int(steps * 0.4) :] *= 1.001
    if "stop" in faults:
        present[rank_of("stop"), int(steps * 0.6) :] = False
    if "gaps" in faults:
        middle = np.arange(5, steps - 5)
        gone = rng.choice(middle, max(3, steps // 10), replace=False)
        present[rank_of("gaps"), gone] = False
    if "slow" in faults:
        step_time[rank_of("slow")] *= 1.25
    if "noisy" in faults:
        r = rank_of("noisy")
        loss[r] += rng.normal(0, 4 * LOSS_NOISE, steps)  # with its own noise: about 5x as much
    if "spikes" in faults:
        loss[rank_of("spikes"), [int(steps * 0.3), int(steps * 0.7)]] *= 3.0
    if "nan" in faults:
        loss[rank_of("nan"), int(steps * 0.5)] = np.nan
    if "weights" in faults:
        r = rank_of("weights")
        weights[r] *= ranks  # one rank with as many samples as all the others together...
        loss[r] += 1.5 * LOSS_NOISE  # ...whose loss is a little higher, within the others' spread
    return np.stack([loss, grad, step_time], axis=2), weights, present
