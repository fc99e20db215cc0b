"""System metrics per rank on the real stack (contract 2): 8 real processes (``tests/system_job.py``, thread
mode, no code of their own for it) sample themselves; one that leaks 2 MiB a step is named, alone, with a
forecast of when it reaches its memory limit near the truth, and a healthy job whose rank 0 holds
600 MiB more while it evaluates says nothing at warning or above."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import instantml as im
from tests.faults import wait_for

PROJECT, WORLD, STEPS, LEAK_RANK, LEAK_MB = "system-metrics", 8, 300, 3, 2.0
ROOT = Path(__file__).resolve().parents[2]


def _job(stack: Any, run_id: str, **env: str) -> list[subprocess.Popen[bytes]]:
    environ = {
        **os.environ,
        "INSTANTML_API_URL": stack.url,
        "INSTANTML_API_KEY": stack.token,
        "INSTANTML_SYSTEM_INTERVAL_S": "0.25",  # (10 s by default: the test's job lasts 6 s)
        "PROJECT": PROJECT,
        "RUN_ID": run_id,
        "STEPS": str(STEPS),
        "WORLD_SIZE": str(WORLD),
        **env,
    }
    environ.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "tests.system_job"]
    return [subprocess.Popen(command, cwd=ROOT, env={**environ, "RANK": str(r)}) for r in range(WORLD)]


def _finished(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        assert proc.wait(timeout=120) == 0


def _summary(api: im.Api, run_id: str) -> dict[str, Any]:
    def complete() -> dict[str, Any] | None:
        summary = api.run(PROJECT, run_id).summary()
        return summary if summary["coverage"]["reported"][-1:] == [WORLD] else None

    summary: dict[str, Any] = wait_for(complete, 60, "every rank's last step in the summary")
    return summary


def test_a_leaking_rank_is_named_with_its_forecast_and_a_healthy_job_says_nothing(local_stack: Any) -> None:
    leaking = _job(local_stack, "leaking", LEAK_RANK=str(LEAK_RANK), LEAK_MB=str(LEAK_MB))
    healthy = _job(local_stack, "healthy", EVAL_EVERY="100", EVAL_MB="600")
    _finished(leaking + healthy)
    api = im.Api(local_stack.url, local_stack.token)

    summary = _summary(api, "leaking")
    assert {"system/rss_mb", "system/cpu_percent", "system/memory_limit_mb"} <= set(summary["keys"])
    alarms = [f for f in summary["findings"] if f["severity"] in ("warning", "critical")]
    assert [(f["kind"], f["rank"], f["key"]) for f in alarms] == [
        ("memory_growth", LEAK_RANK, "system/rss_mb")
    ], alarms
    (row,) = alarms
    assert "keeps growing" in row["message"] and "reaches its limit of" in row["message"], row
    values = api.run(PROJECT, "leaking").rank_metrics(keys=["system/rss_mb", "system/memory_limit_mb"])
    rss, limit = values.to_numpy("system/rss_mb"), values.to_numpy("system/memory_limit_mb")
    last = int(np.flatnonzero(np.isfinite(rss[LEAK_RANK]))[-1])
    steps = values.steps("system/rss_mb")
    truth = steps[last] + (limit[LEAK_RANK, last] - rss[LEAK_RANK, last]) / LEAK_MB
    ahead = truth - steps[last]
    assert abs(row["forecast_step"] - truth) <= 0.1 * ahead, (row["forecast_step"], truth)

    healthy_summary = _summary(api, "healthy")
    assert "system/rss_mb" in healthy_summary["keys"]
    loud = [f for f in healthy_summary["findings"] if f["severity"] in ("warning", "critical")]
    assert loud == [], [f["message"] for f in loud]
