"""Drive ``tests/ddp_fault_job.py`` under torchrun against a local stack with a webhook, as a person on
call would live it: when the fault happened, which alerts reached the webhook and when, and whether
every event the survivors logged before the launcher ended them is stored. For the tests of
``tests/stack/test_lifecycle_ddp.py`` and ``benchmarks/lifecycle.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import instantml as im
from instantml import routes
from instantml.upload import spool
from instantml.upload.background import uploader_running
from tests.faults import Receiver, call, wait_for
from tests.torchrun_jobs import ROOT, torchrun_command

JOB = ROOT / "tests" / "ddp_fault_job.py"
#: How long the webhook is watched once the job has ended and its spools drained: ten watch rounds of
#: the local stack the tests run (0.5 s), for an alert that would blame a victim late.
SETTLE_S = 5.0


@dataclass
class Outcome:
    run_id: str
    fault_at: float  # when the faulty rank logged its last step (time.time(), from its progress file)
    alerts: list[tuple[float, dict[str, Any]]] = field(
        default_factory=list
    )  # (seconds after the fault, post)
    missing: dict[int, list[int]] = field(default_factory=dict)  # rank -> steps it logged, not stored
    exit_code: int | None = None

    def first_naming(self, rank: int) -> tuple[float, dict[str, Any]] | None:
        return next(((t, a) for t, a in self.alerts if a["finding"].get("rank") == rank), None)

    def blaming_others(self, rank: int | None) -> list[dict[str, Any]]:
        """Alerts at warning or above that name a rank other than ``rank``."""
        return [
            a
            for _, a in self.alerts
            if a["finding"].get("rank") not in (None, rank) and a["finding"]["severity"] != "info"
        ]


def progress(directory: Path, rank: int) -> list[int]:
    path = directory / f"rank{rank}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def run_fault(
    stack: Any,
    receiver: Receiver,
    workdir: Path,
    run_id: str,
    fault: str,
    ranks: int = 4,
    mode: str = "thread",
    fault_rank: int = 1,
    fault_step: int = 20,
    wait_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> Outcome:
    """One job with one fault; returns once the alert naming ``fault_rank`` arrived (or ``wait_s``
    passed), torchrun has ended and every spool has drained."""
    steps = workdir / "progress"
    steps.mkdir(parents=True)
    environ = {
        **os.environ,
        "INSTANTML_API_URL": stack.url,
        "INSTANTML_API_KEY": stack.token,
        "INSTANTML_SPOOL_DIR": str(workdir / "spool"),
        "UPLOAD_MODE": mode,
        "FAULT": fault,
        "FAULT_RANK": str(fault_rank),
        "FAULT_STEP": str(fault_step),
        "PROGRESS": str(steps),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    environ.pop("INSTANTML_RUN_ID", None)
    cmd = torchrun_command(ranks, run_id, JOB, "--max-restarts=0")
    log = (workdir / "torchrun.log").open("w")
    proc = subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        last = fault_step if fault == "kill" else fault_step - 1  # the last step the faulty rank logs
        wait_for(
            lambda: last in progress(steps, fault_rank) or proc.poll() is not None, 180, "the fault's step"
        )
        # The fault follows the faulty rank's last logged step at once: its write is the fault's time.
        outcome = Outcome(run_id, (steps / f"rank{fault_rank}").stat().st_mtime)
        seen = 0

        def collect() -> None:
            nonlocal seen
            posts = [
                (t, p) for t, p in zip(receiver.arrived, receiver.posts, strict=True) if p["run_id"] == run_id
            ]
            for t, post in posts[seen:]:
                if post["state"] == "opened":
                    outcome.alerts.append((t - outcome.fault_at, post))
            seen = len(posts)

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and outcome.first_naming(fault_rank) is None:
            if fault == "pause" and proc.poll() is not None:
                break
            collect()
            time.sleep(0.2)
        if proc.poll() is None:  # a hang: the person on call ends the job, as the launcher would
            proc.send_signal(signal.SIGTERM)
        outcome.exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    spool_dir = workdir / "spool"
    wait_for(
        lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir),
        120,
        "the spools to drain",
    )
    settle = time.monotonic() + SETTLE_S  # what the watch says once everything has ended
    while time.monotonic() < settle:
        collect()
        time.sleep(0.2)
    stored: dict[int, set[int]] = {}
    for row in im.Api(stack.url, stack.token).run("faults", run_id).rank_metrics(keys=["train/loss"]):
        stored.setdefault(row.rank, set()).add(row.step)
    for rank in range(ranks):
        outcome.missing[rank] = sorted(set(progress(steps, rank)) - stored.get(rank, set()))
    return outcome


def hook(stack: Any, receiver: Receiver) -> None:
    """The webhook of the project ``faults``, at ``warning``."""
    status, _ = call(
        stack, "PUT", routes.ALERTS.format(project="faults"), {"webhooks": [{"url": receiver.url}]}
    )
    assert status == 200
