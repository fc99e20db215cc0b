"""The system metrics' findings (contract 2, ``shared.findings.system``) on matrices shaped as the summary
gives them: one sample every few columns per rank, heavy-tailed noise, the allocator's steps, warm-up,
rank 0's evaluation. A leaking rank is named with a forecast near the truth; healthy jobs say nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from shared.findings import Finding, system_findings
from shared.store.port import StoredEvent
from shared.summary.decoding import decode
from shared.summary.document import summarize
from shared.summary.query import SummaryQuery

RANKS, COLUMNS, EVERY = 8, 400, 10  # a column a step; a sample every 10 steps
LIMIT = 16_384.0


def _job(seed: int, leak: dict[int, float] | None = None, eval_rank0: bool = False) -> dict[str, np.ndarray]:
    """rss_mb of every rank: 2 GB, a warm-up all ranks share over the first 60 steps, the allocator
    taking 64 MB at random times (and keeping it), heavy-tailed noise, and each leaking rank's MB a step
    from step 150 on; rank 0 evaluates every 100 steps (1.5 GB more for 20 steps)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(COLUMNS)
    rss = np.full((RANKS, COLUMNS), np.nan)
    for rank in range(RANKS):
        level = 2_000 + 600 * np.minimum(steps, 60) / 60
        if rank not in (leak or {}):  # (a leaking rank's growth is its leak alone: the truth is known)
            level = level + 64 * np.cumsum(rng.random(COLUMNS) < 0.003)
        level = level + 5 * rng.standard_t(2, COLUMNS)
        if eval_rank0 and rank == 0:
            level = level + 1_500 * ((steps % 100) >= 80)
        for r, rate in (leak or {}).items():
            if r == rank:
                level = level + rate * np.maximum(0, steps - 150)
        sampled = (steps + rank) % EVERY == 0
        rss[rank, sampled] = level[sampled]
    limit = np.where(np.isfinite(rss), LIMIT, np.nan)
    return {"system/rss_mb": rss, "system/memory_limit_mb": limit}


def _rows(values: dict[str, np.ndarray], upto: int = COLUMNS) -> list[Finding]:
    cut = {k: v[:, :upto] for k, v in values.items()}
    return [f for f in system_findings(cut, np.arange(upto)) if f["severity"] in ("warning", "critical")]


@pytest.mark.parametrize("seed", range(20))
def test_healthy_jobs_with_warm_up_allocator_steps_and_rank0_evaluation_say_nothing(seed: int) -> None:
    assert _rows(_job(seed, eval_rank0=True)) == []


@pytest.mark.parametrize("seed", range(10))
def test_a_rank_leaking_5_mb_a_step_is_named_with_its_forecast(seed: int) -> None:
    values = _job(seed, leak={5: 5.0}, eval_rank0=True)
    rows = _rows(values)
    assert [(f["kind"], f["rank"]) for f in rows] == [("memory_growth", 5)], rows
    (row,) = rows
    # The truth: the rank's level (about 2,600 MB after the warm-up, plus the allocator's steps) reaches
    # the limit at 5 MB a step from step 150.
    last = int(np.flatnonzero(np.isfinite(values["system/rss_mb"][5]))[-1])
    now = values["system/rss_mb"][5, last]
    truth = last + (LIMIT - now) / 5.0
    assert abs(row["forecast_step"] - truth) <= 0.1 * (truth - last), (row, truth)
    rate = float(re.search(r"keeps growing: ([0-9.]+) MB a step", row["message"])[1])  # type: ignore[index]
    assert 4.5 <= rate <= 5.5, row["message"]
    assert "reaches its limit of 16,384 MB at about step" in row["message"]


def test_a_leak_is_found_within_a_few_samples_after_it_is_clear() -> None:
    """The leak starts at step 150; by 10 samples (100 steps) after it has grown past the rule's 100 MB
    and 5%, it is named."""
    values = _job(3, leak={2: 5.0})
    assert _rows(values, upto=200) == []  # 50 steps in: 250 MB, but not yet steady over its samples
    found = next(upto for upto in range(150, COLUMNS, EVERY) if _rows(values, upto))
    assert found <= 150 + 12 * EVERY, found


def test_every_rank_growing_together_is_nobodys_leak() -> None:
    values = _job(4, leak=dict.fromkeys(range(RANKS), 2.0))
    assert _rows(values) == []


def test_a_rank_holding_twice_its_peers_memory_is_named_once() -> None:
    values = _job(5)
    values["system/rss_mb"][6] += 4_000
    rows = _rows(values)
    assert [(f["kind"], f["rank"]) for f in rows] == [("memory_high", 6)], rows
    assert re.search(
        r"holds [0-9,]+ MB \(system/rss_mb\), 2\.[0-9]x the median of its peers'", rows[0]["message"]
    )


def test_a_gpu_far_less_busy_than_its_peers_is_named() -> None:
    rng = np.random.default_rng(6)
    util = np.clip(rng.normal(92, 4, (RANKS, 40)), 0, 100)
    util[3] = np.clip(rng.normal(30, 10, 40), 0, 100)
    rows = _rows({"system/gpu_util_percent": util}, 40)
    assert [(f["kind"], f["rank"]) for f in rows] == [("gpu_idle", 3)], rows
    assert _rows({"system/gpu_util_percent": np.clip(rng.normal(60, 25, (RANKS, 40)), 0, 100)}, 40) == []


def test_a_summary_judges_system_keys_by_these_rules_only() -> None:
    """Through the summary: the system keys raise no generic rows (rank 0's extra memory is not a
    persistent outlier), and the leaking rank's row is there."""
    values = _job(7, leak={1: 5.0}, eval_rank0=True)
    rng = np.random.default_rng(7)
    events = []
    for rank in range(RANKS):
        for step in range(COLUMNS):
            loss = 1.0 + 0.02 * rng.standard_normal()
            events.append(_event(f"t{rank}-{step}", step, rank, {"train/loss": loss}))
            sample = {k: float(m[rank, step]) for k, m in values.items() if np.isfinite(m[rank, step])}
            if sample:  # the monitor's own event, at the same step
                events.append(_event(f"s{rank}-{step}", step, rank, sample))
    summary = summarize(decode(events), "p", "r", SummaryQuery())
    kinds = [(f["kind"], f["rank"], f["key"]) for f in summary["findings"] if f["severity"] != "info"]
    assert kinds == [("memory_growth", 1, "system/rss_mb")], summary["findings"]


def _event(event_id: str, step: int, rank: int, metrics: dict[str, float]) -> StoredEvent:
    packed = np.array([1.0, float(step), *metrics.values()], "<f8").tobytes()
    return StoredEvent(event_id, step, rank, RANKS, list(metrics), packed)


@pytest.mark.parametrize("held", [2, 4, 6])
def test_rank0_still_evaluating_when_the_run_is_read_is_not_a_leak_nor_apart(held: int) -> None:
    """The summary read while rank 0 evaluates: its last ``held`` samples 1.5 GB up, its peers flat."""
    values = _job(8)
    rss = values["system/rss_mb"]
    sampled = np.flatnonzero(np.isfinite(rss[0]))
    rss[0, sampled[-held:]] += 1_500
    assert _rows(values) == []


def test_a_quiet_process_creeping_by_kilobytes_with_an_evaluation_at_the_end_is_not_a_leak() -> None:
    """As a real small process samples: 26 MB creeping by a few KB a sample, no noise; rank 0 holds
    600 MB more for its last 5 samples (it evaluates as the run is read)."""
    steps = np.arange(COLUMNS)
    rss = np.where((steps[None, :] + np.arange(RANKS)[:, None]) % EVERY == 0, 26.0 + 0.0004 * steps, np.nan)
    sampled = np.flatnonzero(np.isfinite(rss[0]))
    rss[0, sampled[-5:]] += 600
    assert _rows({"system/rss_mb": rss}) == []


def test_each_rank_s_peers_median_is_the_median_of_the_others_values() -> None:
    from shared.findings.system import _peer_medians

    rng = np.random.default_rng(38)
    for n in (2, 3, 4, 7, 8, 64):
        for values in (rng.normal(size=n), rng.integers(0, 3, size=n).astype(float)):  # ties too
            by_rank = {rank * 3 + 1: float(v) for rank, v in enumerate(values)}
            got = _peer_medians(by_rank)
            want = {r: float(np.median([v for o, v in by_rank.items() if o != r])) for r in by_rank}
            assert got == pytest.approx(want), (n, values)
