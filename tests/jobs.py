"""Synthetic distributed jobs for judging the findings: healthy ones under realistic noise, and faulty
ones that say which findings they must raise. Pure numpy, seeded, fast (512 ranks x 200 steps: well
under a second).

    job = healthy_job("realistic", ranks=64, steps=200, seed=0)       # job.expected == []
    job = faulty_job("slow", 0.5, ranks=8, steps=200, seed=0)        # one rank's data loading +50%
    summary = summarize(decode(job.events), "p", "r", SummaryQuery())
    assert not job.missed(summary["findings"])                       # every expected finding is there
    job.unexpected(summary["findings"])                              # warning/critical rows beyond them

Each step of data-parallel training (DDP) on rank r, as the job models it:

- ``system/data_time``: the rank's own wait for its batch (about 5 ms, occasional blips of 2-6x);
- its own forward and backward (about 250 ms), then the gradient all-reduce, which waits for the
  slowest rank: every rank leaves it at the same moment;
- ``system/compute_time``: from having the batch to leaving the all-reduce, so it includes the wait: a
  rank that loads data slowly has a LOWER compute_time than the others;
- ``system/step_time``: the whole step, nearly the same on every rank (the slowest rank's work plus a
  small per-rank optimizer step);
- ``train/loss``: a decaying curve shared by all ranks times per-rank data noise (multiplicative);
- ``optimizer/grad_norm``: all-reduced, bit-identical on every rank;
- weights: the batch's tokens (1024 x 14-18 sequences), uneven but unrelated to the values.

Healthy noise models (``MODELS``), nothing wrong with any rank in any of them:

- ``gaussian``: normal noise (loss 2%, data time 10%, compute 1%);
- ``student_t3``: Student-t with 3 degrees of freedom instead (loss at a scale of 1.5%);
- ``lognormal``: lognormal data, compute and optimizer times;
- ``rare_stalls``: on 1.5% of steps one random rank's data loading stalls for 10-30% of a step (so that
  step is longer for everyone, and that rank's compute_time lower);
- ``checkpoint_stalls``: every 50 steps all ranks save a checkpoint (+2 s on step_time, ending together);
- ``warmup``: the first steps are slower on every rank (compilation, cold caches that differ per rank);
- ``uneven_noise``: each rank's noise level is its own, up to 1.5x apart;
- ``integer_tokens``: also logs ``train/tokens`` (integers with many ties: often MAD 0);
- ``constant``: also logs ``optimizer/lr``, the same constant on every rank at every step;
- ``elastic``: the world shrinks by a quarter halfway (8 -> 6): the ranks beyond it stop, and the
  events say so in ``world_size``;
- ``lost_events``: single events lost at random, 1 in 5,000;
- ``realistic``: all of the above but ``elastic`` (what a real cluster looks like).

Faults (``FAULT_SIZES``), each on a seeded random rank, and the findings they must raise
(``Expected(kind, rank, key)``; a key of None where the finding has none):

- ``stopped``: the rank stops reporting; size: the share of the run left when it stops (< 1) or a
  number of steps (>= 1). -> ``stopped_reporting``.
- ``gaps``: the rank is absent at a share ``size`` of the steps. -> ``missing_steps``.
- ``slow``: the rank's data loading takes ``1 + size`` times as long (so, by DDP, every rank's
  step_time grows and the slow rank's compute_time is lower). -> ``straggler`` on data_time; below +10%
  a ``persistent_outlier`` there counts too (``Job.aliases``).
- ``slow_node``: the same on all 8 ranks of one node (needs 16 ranks or more). -> ``node_outlier``
  named by the node's first rank, on data_time.
- ``noisy``: the rank's loss noise is ``size`` times as large. -> ``noisy_rank`` on the loss.
- ``spikes``: the rank's loss is ``size`` times as large at ``width`` consecutive steps. -> ``spike``.
- ``nan_once``, ``nan_persistent``: the rank's loss is NaN at one step, or from one step on (size
  unused). -> ``nonfinite`` on the loss.
- ``desync``: from some step on, the rank's grad_norm is ``1 + size`` times the all-reduced value.
  -> ``rank_disagreement`` on grad_norm.
- ``weights``: the rank reports a larger weight and a loss 1.5 noise levels higher (within the
  spread), so the weighted mean moves from the plain mean by about ``size`` noise levels.
  -> ``weighted_differs`` on the loss (its severity is ``info``; found is found).
- ``two_faulty``: ``slow`` at ``size`` on one rank and ``noisy`` at 3x on another. -> both findings.

A fault draws from a random stream of its own: ``faulty_job(..., seed=s)`` is ``healthy_job(...,
seed=s)`` with the fault added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from shared.findings import Finding
from shared.store.port import StoredEvent

LOSS, GRAD = "train/loss", "optimizer/grad_norm"
DATA_TIME, COMPUTE_TIME, STEP_TIME = "system/data_time", "system/compute_time", "system/step_time"
TOKENS, LR = "train/tokens", "optimizer/lr"
RANKS_PER_NODE = 8
#: Alarm severities: a healthy job raises none.
ALARMS = ("warning", "critical")

DATA_SECONDS, COMPUTE_SECONDS, ALLREDUCE_SECONDS, OPTIMIZER_SECONDS = 0.005, 0.25, 0.02, 0.003
STEP_SECONDS = DATA_SECONDS + COMPUTE_SECONDS + ALLREDUCE_SECONDS
#: Relative noise levels (the scale of the unit noise: a standard deviation for gaussian noise).
LOSS_LEVEL = {"gaussian": 0.02, "student_t3": 0.015}
DATA_LEVEL, COMPUTE_LEVEL, OPTIMIZER_LEVEL = 0.1, 0.01, 0.1
BLIP_RATE = 0.003
CHECKPOINT_SECONDS = 2.0
#: ``weights``: the faulty rank's loss sits this many noise levels above the others'.
WEIGHTED_OFFSET = 1.5


@dataclass(frozen=True)
class Noise:
    """A healthy noise model: the noise's distribution and the healthy events a real cluster has."""

    family: str = "gaussian"  # per-rank noise: "gaussian" or "student_t3"
    times: str = "same"  # "lognormal": data, compute and optimizer times lognormal instead
    uneven: float = 1.0  # ranks' noise levels up to this many times apart
    stalls: float = 0.0  # share of steps at which one random rank's data loading stalls
    checkpoint_every: int = 0
    warmup: int = 0  # steps
    tokens: bool = False
    constant: bool = False
    shrink: bool = False
    lost: float = 0.0  # share of events lost


MODELS: dict[str, Noise] = {
    "gaussian": Noise(),
    "student_t3": Noise(family="student_t3"),
    "lognormal": Noise(times="lognormal"),
    "rare_stalls": Noise(stalls=0.015),
    "checkpoint_stalls": Noise(checkpoint_every=50),
    "warmup": Noise(warmup=10),
    "uneven_noise": Noise(uneven=1.5),
    "integer_tokens": Noise(tokens=True),
    "constant": Noise(constant=True),
    "elastic": Noise(shrink=True),
    "lost_events": Noise(lost=1 / 5000),
    "realistic": Noise(
        family="student_t3",
        times="lognormal",
        uneven=1.5,
        stalls=0.015,
        checkpoint_every=50,
        warmup=10,
        tokens=True,
        constant=True,
        lost=1 / 5000,
    ),
}

#: fault -> the sizes the benchmark tries, smallest (hardest) first.
FAULT_SIZES: dict[str, tuple[float, ...]] = {
    "stopped": (3, 0.5, 0.9),
    "gaps": (0.01, 0.05, 0.2),
    "slow": (0.05, 0.1, 0.2, 0.5),
    "slow_node": (0.05, 0.1, 0.2, 0.5),
    "noisy": (1.5, 2.0, 3.0, 5.0),
    "spikes": (3.0, 8.0, 100.0),
    "nan_once": (1.0,),
    "nan_persistent": (1.0,),
    "desync": (1e-6, 1e-3, 0.1),
    "weights": (0.1, 0.25, 0.5, 1.0),
    "two_faulty": (0.1, 0.5),
}
#: The size at which each fault is plainly there (the tests require these to be found).
CLEAR_SIZE: dict[str, float] = {
    "stopped": 0.5,
    "gaps": 0.05,
    "slow": 0.5,
    "slow_node": 0.5,
    "noisy": 3.0,
    "spikes": 8.0,
    "nan_once": 1.0,
    "nan_persistent": 1.0,
    "desync": 1e-3,
    "weights": 1.0,
    "two_faulty": 0.5,
}
#: Faults that can be told apart at 2 ranks (which of two ranks is noisy or desynced cannot).
AT_TWO_RANKS = ("stopped", "gaps", "slow", "spikes", "nan_once", "nan_persistent")
#: Up to this size a slow rank may be reported as a plain persistent outlier on its data time: at +10%
#: of a 5 ms data time the others wait 0.5 ms a step, a fifth of compute_time's own noise (1% of 250 ms),
#: so the wait that makes it a straggler cannot be seen.
SLOW_ALIAS_UP_TO = 0.1


class Expected(NamedTuple):
    """A finding a job must raise: ``kind``, ``rank`` (None: about no rank) and ``key`` (None: no key)."""

    kind: str
    rank: int | None
    key: str | None


@dataclass
class Job:
    """A synthetic job: its stored events and the findings it must raise (none for a healthy job)."""

    events: list[StoredEvent]
    expected: list[Expected]
    #: expected kind -> other kinds that also count as found (same rank and key)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    ranks: int = 0
    steps: int = 0

    def accepted(self) -> set[tuple[str, int | None, str | None]]:
        return {
            (kind, e.rank, e.key) for e in self.expected for kind in (e.kind, *self.aliases.get(e.kind, ()))
        }

    def missed(self, findings: list[Finding]) -> list[Expected]:
        """The expected findings absent from ``findings`` (at any severity, aliases allowed)."""
        found = {(f["kind"], f["rank"], f["key"]) for f in findings}
        return [
            e
            for e in self.expected
            if not any((kind, e.rank, e.key) in found for kind in (e.kind, *self.aliases.get(e.kind, ())))
        ]

    def unexpected(self, findings: list[Finding]) -> list[Finding]:
        """The ``warning`` and ``critical`` rows of ``findings`` that the job does not expect."""
        accepted = self.accepted()
        return [
            f
            for f in findings
            if f["severity"] in ALARMS and (f["kind"], f["rank"], f["key"]) not in accepted
        ]


def healthy_job(model: str, ranks: int, steps: int, seed: int) -> Job:
    """A job with nothing wrong on any rank, under noise model ``model`` (a key of ``MODELS``)."""
    return _job(model, ranks, steps, seed, None, 0.0, 2)


def faulty_job(
    fault: str, size: float, ranks: int, steps: int, seed: int, model: str = "realistic", width: int = 2
) -> Job:
    """A ``model`` job with ``fault`` (a key of ``FAULT_SIZES``) of ``size`` on seeded random rank(s);
    ``width``: the consecutive steps of a spike."""
    if fault not in FAULT_SIZES:
        raise ValueError(f"unknown fault {fault!r}")
    return _job(model, ranks, steps, seed, fault, size, width)


def describe(fault: str, size: float, width: int = 2) -> str:
    """A fault's size in words, for tables: ``+50%``, ``3x``, ``mid``."""
    if fault in ("slow", "slow_node", "two_faulty"):
        return f"+{size * 100:g}%"
    if fault in ("noisy",):
        return f"{size:g}x"
    if fault == "spikes":
        return f"{size:g}x{width}"
    if fault == "stopped":
        return {0.9: "early", 0.5: "mid"}.get(size, f"last {size:g}" if size >= 1 else f"{size:g}")
    if fault == "gaps":
        return f"{size * 100:g}%"
    if fault == "desync":
        return f"{size:g}"
    if fault == "weights":
        return f"{size:g}σ"
    return "-"


def _unit_noise(rng: np.random.Generator, family: str, shape: tuple[int, ...]) -> np.ndarray:
    if family == "student_t3":
        return rng.standard_t(3, shape)
    return rng.standard_normal(shape)


def _factor(rng: np.random.Generator, noise: Noise, level: Any, shape: tuple[int, int]) -> np.ndarray:
    """Multiplicative noise of a time: ``1 + level * unit`` (kept above 0.3) or lognormal."""
    if noise.times == "lognormal":
        out: np.ndarray = np.exp(level * rng.standard_normal(shape) - level**2 / 2)
        return out
    bounded: np.ndarray = np.maximum(1 + level * _unit_noise(rng, noise.family, shape), 0.3)
    return bounded


def _job(model: str, ranks: int, steps: int, seed: int, fault: str | None, size: float, width: int) -> Job:
    noise = MODELS[model]
    rng = np.random.default_rng(seed)
    shape = (ranks, steps)
    step = np.arange(steps)

    # The healthy job, every draw from ``rng`` in a fixed order whatever the fault.
    uneven = np.exp(rng.uniform(0, np.log(noise.uneven), (ranks, 1)))  # 1 when even
    data = DATA_SECONDS * _factor(rng, noise, DATA_LEVEL * uneven, shape)
    blips = rng.random(shape) < BLIP_RATE
    data[blips] *= rng.uniform(2, 6, int(blips.sum()))
    own = COMPUTE_SECONDS * _factor(rng, noise, COMPUTE_LEVEL * uneven, shape)
    optimizer = OPTIMIZER_SECONDS * _factor(rng, noise, OPTIMIZER_LEVEL * uneven, shape)
    allreduce = ALLREDUCE_SECONDS * np.maximum(1 + 0.05 * rng.standard_normal(steps), 0.5)
    fade = np.exp(-step / max(noise.warmup / 3, 1e-9)) if noise.warmup else np.zeros(steps)
    if noise.stalls:
        at = np.nonzero(rng.random(steps) < noise.stalls)[0]
        data[rng.integers(0, ranks, len(at)), at] += rng.uniform(0.1, 0.3, len(at)) * STEP_SECONDS
    if noise.warmup:
        own *= 1 + 3 * fade * rng.uniform(0.9, 1.1, shape)  # compilation and allocator warm-up
        data *= 1 + 10 * fade * rng.uniform(0.5, 1.5, shape)  # caches, cold on each rank its own way
    loss_level = LOSS_LEVEL[noise.family] * uneven
    loss_noise = _unit_noise(rng, noise.family, shape)
    curve = 2.4 * np.exp(-step / max(steps / 3, 1)) + 0.2
    trend = curve * (1 + 0.005 * rng.standard_normal(steps))  # the model's state: shared by all ranks
    grad = 3.0 * np.exp(0.1 * rng.standard_normal(steps)) * (1 + 2 * fade)
    sequences = rng.choice([14, 15, 16, 17, 18], shape, p=[0.05, 0.2, 0.5, 0.2, 0.05])
    weights = 1024.0 * sequences
    tokens = weights.copy()
    checkpoints = (
        step[(step > 0) & (step % noise.checkpoint_every == 0)] if noise.checkpoint_every else step[:0]
    )
    saves = CHECKPOINT_SECONDS * (1 + 0.1 * rng.standard_normal(len(checkpoints)))
    save_jitter = rng.normal(0, 0.001, (ranks, len(checkpoints)))
    present = rng.random(shape) >= noise.lost
    world = np.full(steps, ranks)
    if noise.shrink:
        world[steps // 2 :] = max(1, ranks * 3 // 4)
        present &= np.arange(ranks)[:, None] < world[None, :]

    # The fault, from a stream of its own, on ranks that report throughout.
    frng = np.random.default_rng([seed, 14])
    survivors = int(world.min())
    expected: list[Expected] = []
    aliases: dict[str, tuple[str, ...]] = {}
    faulty = frng.permutation(survivors)[:2].tolist()
    middle = int(frng.integers(steps // 4, max(steps // 4 + 1, 3 * steps // 4)))
    slow_size = size if fault in ("slow", "two_faulty", "slow_node") else 0.0
    if fault in ("slow", "two_faulty"):
        data[faulty[0]] *= 1 + slow_size
        expected.append(Expected("straggler", faulty[0], DATA_TIME))
        if slow_size <= SLOW_ALIAS_UP_TO:
            aliases["straggler"] = ("persistent_outlier",)
    if fault == "slow_node":
        if survivors < 2 * RANKS_PER_NODE:
            raise ValueError("slow_node needs at least 16 ranks")
        node = int(frng.integers(0, survivors // RANKS_PER_NODE))
        data[node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE] *= 1 + slow_size
        expected.append(Expected("node_outlier", node * RANKS_PER_NODE, DATA_TIME))
    if fault in ("noisy", "two_faulty"):
        r = faulty[-1]
        loss_level[r] *= 3.0 if fault == "two_faulty" else size
        expected.append(Expected("noisy_rank", r, LOSS))

    # DDP: the all-reduce waits for the slowest rank; every rank leaves it together.
    sync = (data + own).max(axis=0) + allreduce
    compute_time = sync - data
    step_time = sync + optimizer
    step_time[:, checkpoints] += saves + save_jitter
    loss = trend * np.maximum(1 + loss_level * loss_noise, 0.3)
    grads = np.repeat(grad[None, :], ranks, axis=0)

    r = faulty[0]
    if fault == "spikes":
        start = int(frng.integers(steps // 10, max(steps // 10 + 1, steps - steps // 10 - width)))
        loss[r, start : start + width] *= size
        expected.append(Expected("spike", r, LOSS))
    elif fault == "nan_once":
        loss[r, middle] = np.nan
        expected.append(Expected("nonfinite", r, LOSS))
    elif fault == "nan_persistent":
        loss[r, middle:] = np.nan
        expected.append(Expected("nonfinite", r, LOSS))
    elif fault == "desync":
        grads[r, middle:] *= 1 + size
        expected.append(Expected("rank_disagreement", r, GRAD))
    elif fault == "weights":
        loss[r] *= 1 + WEIGHTED_OFFSET * loss_level[r]
        share = min(size / WEIGHTED_OFFSET + 1 / ranks, 0.95)  # the weight share that moves it by size
        weights[r] *= (ranks - 1) * share / (1 - share)
        expected.append(Expected("weighted_differs", r, LOSS))
    elif fault == "stopped":
        behind = int(size) if size >= 1 else max(1, round(size * steps))
        present[r, steps - behind :] = False
        expected.append(Expected("stopped_reporting", r, None))
    elif fault == "gaps":
        inside = np.arange(5, steps - 5)
        gone = frng.choice(inside, max(1, round(size * steps)), replace=False)
        present[r, gone] = False
        expected.append(Expected("missing_steps", r, None))

    columns = [loss, grads, data, compute_time, step_time]
    keys = [LOSS, GRAD, DATA_TIME, COMPUTE_TIME, STEP_TIME]
    if noise.tokens:
        columns.append(tokens)
        keys.append(TOKENS)
    if noise.constant:
        columns.append(np.full(shape, 3e-4))
        keys.append(LR)
    clock = np.cumsum(step_time, axis=1)
    packed = np.stack([weights, clock, *columns], axis=2).astype("<f8")
    return Job(_events(packed, present, world, keys), expected, aliases, keys, ranks, steps)


def _events(packed: np.ndarray, present: np.ndarray, world: np.ndarray, keys: list[str]) -> list[StoredEvent]:
    """One stored event per present (rank, step), in step order as a store reads them."""
    steps, width = packed.shape[1], packed.shape[2] * 8
    raw = packed.tobytes()
    sizes = world.tolist()
    steps_of, ranks_of = np.nonzero(present.T)
    blobs = [raw[at : at + width] for at in ((ranks_of * steps + steps_of) * width).tolist()]
    rows = zip(steps_of.tolist(), ranks_of.tolist(), blobs, strict=True)
    return [StoredEvent(f"e-{r}-{s}", s, r, sizes[s], keys, blob, r % RANKS_PER_NODE) for s, r, blob in rows]
