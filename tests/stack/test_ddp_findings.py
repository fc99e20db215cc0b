"""A real distributed job's findings: ``torchrun --nproc-per-node 8`` runs examples/ddp_faults.py (DDP on
the CPU, gloo, spool mode) against the local stack three times: clean, with one rank's data loading
slowed down, and with one rank's shard mislabelled. The Distributed summary must name the faulty rank on
the right key, and only that rank.

Like tests/stack/test_torchrun.py this needs ``.cache/venv-torch`` (``make test`` builds it). Each job runs
once per module, whichever tests ask for it. ``DDP_SUMMARIES_DIR=DIR`` also saves each job's summary as
``DIR/<job>.json``, for replaying them against the findings.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from instantml import routes
from tests.faults import wait_for
from tests.torchrun_jobs import TORCHRUN, run_example

PROJECT = "ddp-faults"  # examples/ddp_faults.py
WORLD_SIZE = 8
STEPS = 60
KEYS = ["train/loss", "optimizer/grad_norm", "system/data_time", "system/compute_time"]
SLOW_RANK, BAD_SHARD_RANK = 3, 5
JOBS: dict[str, dict[str, str]] = {
    "clean": {},
    "slow": {"SLOW_RANK": str(SLOW_RANK), "SLOW_SECONDS": "0.05"},
    "bad_shard": {"BAD_SHARD_RANK": str(BAD_SHARD_RANK)},
}
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not TORCHRUN.exists(), reason="no .cache/venv-torch: `make test` builds it"),
]

Summary = dict[str, Any]


def get_summary(stack: Any, run_id: str) -> Summary:
    path = routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id)
    query = urllib.parse.urlencode({"keys": ",".join(KEYS)})
    request = urllib.request.Request(
        f"{stack.url}{path}?{query}", headers={"Authorization": f"Bearer {stack.token}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        summary: Summary = json.load(response)
    return summary


def complete(summary: Summary) -> bool:
    return bool(
        summary["steps"] == list(range(STEPS)) and summary["coverage"]["reported"] == [WORLD_SIZE] * STEPS
    )


def run_job(stack: Any, name: str, workdir: Path) -> Summary:
    """Run the example under torchrun with the job's faults, wait until every rank's every step is in the
    summary, and return it."""
    run_id = f"ddp-{name}"
    knobs = {knob: JOBS[name].get(knob, "") for knob in ("SLOW_RANK", "SLOW_SECONDS", "BAD_SHARD_RANK")}
    run_example(stack, "ddp_faults.py", WORLD_SIZE, run_id, workdir, {"STEPS": str(STEPS), **knobs})

    def everything_in() -> Summary | None:
        summary = get_summary(stack, run_id)
        return summary if complete(summary) else None

    summary: Summary = wait_for(everything_in, 60, "every step of every rank in the summary")
    saved = os.environ.get("DDP_SUMMARIES_DIR")
    if saved:
        Path(saved).mkdir(parents=True, exist_ok=True)
        (Path(saved) / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


@pytest.fixture(scope="module")
def job(local_stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Summary]:
    """``job(name)``: that job's summary; the job runs the first time it is asked for."""
    done: dict[str, Summary] = {}

    def get(name: str) -> Summary:
        if name not in done:
            done[name] = run_job(local_stack, name, tmp_path_factory.mktemp(name))
        return done[name]

    return get


def flagged(summary: Summary) -> list[dict[str, Any]]:
    return [f for f in summary["findings"] if f["severity"] in ("warning", "critical")]


def listing(findings: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{f['severity']} {f['kind']} rank={f['rank']} key={f['key']}: {f['message']}" for f in findings
    )


@pytest.mark.parametrize("name", list(JOBS))
def test_every_rank_reaches_the_summary(job: Callable[[str], Summary], name: str) -> None:
    summary = job(name)
    assert summary["world_size"] == WORLD_SIZE and summary["ranks"] == list(range(WORLD_SIZE))
    assert set(summary["keys"]) == set(KEYS)
    # DDP all-reduces the gradients, so every rank reports the same grad norm: no desync.
    grad = summary["reducers"]["optimizer/grad_norm"]
    assert all(r <= 1e-4 * m for r, m in zip(grad["range"], grad["max"], strict=True))
    assert not [f for f in summary["findings"] if f["kind"] == "rank_disagreement"]


def test_a_slow_data_loader_is_the_straggler_on_its_data_time(job: Callable[[str], Summary]) -> None:
    found = [f for f in flagged(job("slow")) if f["key"] == "system/data_time" and f["kind"] == "straggler"]
    assert SLOW_RANK in [f["rank"] for f in found], listing(flagged(job("slow")))
    # The others wait for it at the gradient all-reduce: its compute_time is the lowest, in the same row.
    assert "system/compute_time, which includes waiting" in found[0]["message"]


def test_a_bad_shard_is_found_on_its_loss(job: Callable[[str], Summary]) -> None:
    found = [
        f
        for f in flagged(job("bad_shard"))
        if f["key"] == "train/loss" and f["kind"] in ("persistent_outlier", "spike")
    ]
    assert BAD_SHARD_RANK in [f["rank"] for f in found], listing(flagged(job("bad_shard")))


# What each job may flag (warning or critical), as (rank, key) with None for any key.
ALLOWED: dict[str, set[tuple[int, str | None]]] = {
    "clean": set(),
    "slow": {(SLOW_RANK, "system/data_time")},  # one straggler row, not one per key
    "bad_shard": {(BAD_SHARD_RANK, "train/loss")},
}


@pytest.mark.parametrize("name", list(JOBS))
def test_nothing_else_is_flagged(job: Callable[[str], Summary], name: str) -> None:
    others = [
        f
        for f in flagged(job(name))
        if (f["rank"], None) not in ALLOWED[name] and (f["rank"], f["key"]) not in ALLOWED[name]
    ]
    assert not others, listing(others)
