"""Findings on the jobs of tests/jobs.py: a healthy job under every noise model raises no warning or
critical row, and each fault at a size where it is plainly there is found with its kind, rank and key.

The rates over many seeds and sizes are the benchmark's (benchmarks/findings_quality.py); these cases
are the floor.
"""

from __future__ import annotations

from typing import Any

import pytest

from shared.findings import Finding
from shared.summary.decoding import decode
from shared.summary.document import summarize
from shared.summary.query import SummaryQuery
from tests.jobs import CLEAR_SIZE, MODELS, Job, describe, faulty_job, healthy_job

FAULTS = (
    "slow",
    "slow_node",
    "noisy",
    "spikes",
    "stopped",
    "nan_once",
    "nan_persistent",
    "desync",
    "gaps",
    "weights",
    "two_faulty",
)


def _findings(job: Job) -> list[Finding]:
    return summarize(decode(job.events), "p", "r", SummaryQuery())["findings"]


def _healthy_cases() -> list[Any]:
    cases = [(model, ranks, 200, seed) for model in MODELS for ranks in (8, 64) for seed in (0, 1)]
    cases += [("gaussian", 512, 100, 0), ("realistic", 512, 100, 0)]
    return [
        pytest.param(
            *case,
            id=f"{case[0]}-{case[1]}x{case[2]}-seed{case[3]}",
            marks=[pytest.mark.slow] if case[1] == 512 else [],
        )
        for case in cases
    ]


def _fault_cases() -> list[Any]:
    cases = []
    for fault in FAULTS:
        for ranks in (64,) if fault == "slow_node" else (8, 64):
            for seed in (0, 1):
                label = f"{fault}-{describe(fault, CLEAR_SIZE[fault])}-{ranks}-seed{seed}"
                cases.append(pytest.param(fault, ranks, seed, id=label))
    return cases


@pytest.mark.parametrize(("model", "ranks", "steps", "seed"), _healthy_cases())
def test_a_healthy_job_raises_no_warning_or_critical_finding(
    model: str, ranks: int, steps: int, seed: int
) -> None:
    job = healthy_job(model, ranks, steps, seed)
    alarms = job.unexpected(_findings(job))
    assert alarms == [], [(f["kind"], f["rank"], f["key"], f["message"]) for f in alarms[:10]]


@pytest.mark.parametrize(("fault", "ranks", "seed"), _fault_cases())
def test_a_plain_fault_is_found_with_its_kind_rank_and_key(fault: str, ranks: int, seed: int) -> None:
    job = faulty_job(fault, CLEAR_SIZE[fault], ranks, 200, seed)
    findings = _findings(job)
    missed = job.missed(findings)
    assert missed == [], (missed, [(f["kind"], f["rank"], f["key"], f["severity"]) for f in findings[:20]])


def test_a_fault_adds_to_the_healthy_job_of_the_same_seed() -> None:
    healthy = healthy_job("realistic", 8, 50, 3)
    faulty = faulty_job("gaps", 0.2, 8, 50, 3)
    assert healthy.expected == []
    assert len(faulty.expected) == 1
    gone = {(e.step, e.rank) for e in healthy.events} - {(e.step, e.rank) for e in faulty.events}
    assert len(gone) == 10
    assert {r for _, r in gone} == {faulty.expected[0].rank}
    kept = {(e.step, e.rank): e.packed for e in faulty.events}
    assert all(kept[(e.step, e.rank)] == e.packed for e in healthy.events if (e.step, e.rank) in kept)


def test_jobs_have_the_physics_the_findings_rely_on() -> None:
    job = healthy_job("gaussian", 8, 20, 0)
    run = decode(job.events)
    grad = run.value[run.key_id == run.keys.index("optimizer/grad_norm")].reshape(20, 8)
    assert (grad == grad[:, :1]).all()  # all-reduced: bit-identical on every rank
    slow = faulty_job("slow", 0.5, 8, 200, 0, model="gaussian")
    summary = summarize(decode(slow.events), "p", "r", SummaryQuery())
    rank = slow.expected[0].rank
    assert rank is not None
    mean_z = {k: v["mean_z"] or 0.0 for k, v in summary["rank_stats"][rank]["keys"].items()}  # None fails
    assert mean_z["system/data_time"] > 1
    assert mean_z["system/compute_time"] < -1  # waits less


def test_events_carry_the_node_layout() -> None:
    events = healthy_job("gaussian", 16, 2, 0).events
    assert {(e.rank, e.local_rank) for e in events} == {(r, r % 8) for r in range(16)}
