"""Contract 8 on real torch jobs: a DDP job (gloo, 4 ranks under torchrun) against the real local stack
and a real webhook receiver. One rank raises, is SIGKILLed or hangs in its data loading while the others
wait for it in the all-reduce; the person on call gets one alert naming that rank and how, none naming
the ranks the launcher ended after it, and every event the ranks logged is stored. A job that pauses on
every rank at once (an evaluation) stays silent. A job restarted by torchrun from a checkpoint says so,
and an elastic job that loses a node says that its world shrank.

Beats every second (``INSTANTML_BEAT_S=1``) so that a hang is seen in seconds, not in the default 30.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from instantml import routes
from tests.ddp_faults import JOB, Outcome, hook, run_fault
from tests.faults import Receiver, call, free_port, wait_for
from tests.torchrun_jobs import TORCHRUN

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not TORCHRUN.exists(), reason="no .cache/venv-torch: `make test` builds it"),
]

FAST_BEATS = {"INSTANTML_BEAT_S": "1"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from infra.local import LocalStack

    running = LocalStack(
        port=0, data_dir=tmp_path_factory.mktemp("ddp-lifecycle"), watch_interval=0.5
    ).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def receiver(stack: Any) -> Iterator[Receiver]:
    hooked = Receiver()
    hook(stack, hooked)
    try:
        yield hooked
    finally:
        hooked.down()


def alerting(outcome: Outcome) -> list[dict[str, Any]]:
    return [a for _, a in outcome.alerts if a["finding"]["severity"] != "info"]


@pytest.mark.parametrize(
    ("fault", "mode", "kind", "words"),
    [
        ("raise", "thread", "rank_exited", ["raised RuntimeError", "CUDA out of memory", "forward"]),
        ("kill", "spool", "rank_vanished", ["vanished", "SIGKILL", "ended after it"]),
        ("hang", "spool", "rank_stuck", ["load_batch", "the other 3 wait"]),
    ],
)
def test_one_faulty_rank_is_one_alert_naming_it_and_nothing_logged_is_lost(
    stack: Any, receiver: Receiver, tmp_path: Path, fault: str, mode: str, kind: str, words: list[str]
) -> None:
    outcome = run_fault(stack, receiver, tmp_path, f"{fault}-{mode}", fault, mode=mode, env=FAST_BEATS)
    named = outcome.first_naming(1)
    assert named is not None, f"no alert named rank 1: {[a['text'] for _, a in outcome.alerts]}"
    after, alert = named
    assert alert["finding"]["kind"] == kind and all(w in alert["finding"]["message"] for w in words), alert
    assert after < 60, f"the alert came {after:.1f} s after the fault"
    assert outcome.blaming_others(1) == []
    assert len(alerting(outcome)) == 1, [a["text"] for a in alerting(outcome)]
    assert outcome.exit_code != 0  # torchrun says the job failed, as it would without the client
    assert all(outcome.missing[r] == [] for r in (0, 2, 3)), outcome.missing
    assert outcome.missing[1] == []  # a raise is flushed by the excepthook, a kill was spooled
    if fault == "raise":  # `instantml check` says who went first and how, the ranks ended after it apart
        check = subprocess.run(
            [sys.executable, "-m", "instantml.cli", "check", "--project", "faults", outcome.run_id],
            env={**os.environ, "INSTANTML_API_URL": stack.url, "INSTANTML_API_KEY": stack.token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 1, check.stdout + check.stderr
        lines = check.stdout.splitlines()
        assert "processes (4):" in lines, check.stdout
        # the first process line is the one that went first; the others (a collective's error, the
        # launcher's SIGTERM) come after it, every rank in one of them
        culprit = lines[lines.index("processes (4):") + 1]
        assert culprit.startswith("  rank 1: ended: exception RuntimeError at "), check.stdout
        assert "ddp_fault_job.py:" in culprit and culprit.endswith(
            " forward: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.15 GiB total capacity)"
        ), culprit
        ended_after = lines[lines.index(culprit) + 1 : -1]
        assert ended_after and all(": ended: " in line and "rank 1:" not in line for line in ended_after), (
            check.stdout
        )


def test_a_pause_every_rank_shares_is_silent(stack: Any, receiver: Receiver, tmp_path: Path) -> None:
    """Every rank sleeps 8 s at step 20 (8 beats of each rank), then the job finishes."""
    outcome = run_fault(
        stack,
        receiver,
        tmp_path,
        "pause-thread",
        "pause",
        env={**FAST_BEATS, "STEPS": "40", "PAUSE_S": "8"},
    )
    assert outcome.exit_code == 0
    assert alerting(outcome) == [], [a["text"] for a in alerting(outcome)]
    assert all(missing == [] for missing in outcome.missing.values()), outcome.missing


@pytest.mark.parametrize("mode", ["thread", "spool"])
def test_a_restart_from_a_checkpoint_is_said_and_the_failure_before_it_resolves(
    stack: Any, receiver: Receiver, tmp_path: Path, mode: str
) -> None:
    """torchrun --max-restarts=1: rank 1 raises at step 20 of the first attempt, every rank starts
    again from its checkpoint at step 10 and the job finishes. The run says that it restarted, from
    which step and which steps were logged again; the first attempt's failure was alerted, and once
    the job runs again nothing at warning or above is left open."""
    run_id = f"restart-{mode}"
    (tmp_path / "progress").mkdir()
    environ = {
        **os.environ,
        "INSTANTML_API_URL": stack.url,
        "INSTANTML_API_KEY": stack.token,
        "INSTANTML_SPOOL_DIR": str(tmp_path / "spool"),
        "UPLOAD_MODE": mode,
        "FAULT": "raise_once",
        "FAULT_RANK": "1",
        "FAULT_STEP": "20",
        "RESUME_STEP": "10",
        "STEPS": "40",
        "PROGRESS": str(tmp_path / "progress"),
        "OMP_NUM_THREADS": "1",
    }
    # The c10d rendezvous with a store of the workers' own: a restart over the store torchrun shares
    # reads the first attempt's addresses (pytorch#135712, whose workaround this is).
    environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    environ.pop("INSTANTML_RUN_ID", None)
    job = subprocess.run(
        [
            str(TORCHRUN),
            "--nnodes=1",
            "--nproc-per-node=4",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={run_id}",
            "--max-restarts=1",
            str(JOB),
        ],
        env=environ,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    path = routes.RUN.format(project="faults", run_id=run_id)

    def settled() -> dict[str, Any] | None:
        _, run = call(stack, "GET", path)
        rows = (run.get("watch") or {}).get("findings") or []
        restarted = [f for f in rows if f["kind"] == "restarted"]
        open_rows = [f for f in rows if f["severity"] != "info"]
        return run if restarted and not open_rows and run.get("status") == "finished" else None

    run = wait_for(settled, 60, "the restarted row, and nothing at warning or above")
    (row,) = [f for f in run["watch"]["findings"] if f["kind"] == "restarted"]
    assert row["message"].startswith("the job restarted (attempt 1) at step 10: "), row["message"]
    assert "steps 10-" in row["message"] and "were logged again" in row["message"], row["message"]
    assert {p["rank"]: (p["how"], p["attempt"], p["restarts"]) for p in run["processes"]} == dict.fromkeys(
        range(4), ("finished", 1, 1)
    )
    posts = [p for p in receiver.posts if p["run_id"] == run_id]
    opened = [p["finding"] for p in posts if p["state"] == "opened" and p["finding"]["severity"] != "info"]
    assert [(f["kind"], f["rank"]) for f in opened] == [("rank_exited", 1)], opened
    assert any(p["state"] == "resolved" for p in posts), posts


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (torchrun starts its workers in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def test_an_elastic_job_that_loses_a_node_says_its_world_shrank(
    stack: Any, receiver: Receiver, tmp_path: Path
) -> None:
    """Two torchrun agents (``--nnodes=1:2``, 2 ranks each, c10d rendezvous) make a world of 4; at step
    20 one node is lost (its agent and its workers SIGKILLed). The survivors' collective fails, their
    agent restarts them (``--max-restarts=1``) in a world of 2 from the checkpoint at step 10, and the
    job finishes. The run says it restarted and that its world changed from 4 to 2; the lost ranks read
    ``vanished`` rather than running for ever; no alert names a survivor; nothing is left open."""
    run_id = "shrink-thread"
    (tmp_path / "progress").mkdir()
    environ = {
        **os.environ,
        "INSTANTML_API_URL": stack.url,
        "INSTANTML_API_KEY": stack.token,
        "INSTANTML_SPOOL_DIR": str(tmp_path / "spool"),
        "UPLOAD_MODE": "thread",
        "RESUME_STEP": "10",
        "STEPS": "100",
        "PROGRESS": str(tmp_path / "progress"),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # (as in the restart test above: pytorch#135712)
    }
    environ.pop("INSTANTML_RUN_ID", None)
    port = free_port()

    def agent(host: int) -> subprocess.Popen[bytes]:
        # last_call_timeout: a round waits this long for more nodes once one is there (both agents
        # make the first; the restart's has only the survivor); keep-alives say a dead node is gone.
        conf = f"is_host={host},last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
        command = [
            str(TORCHRUN),
            "--nnodes=1:2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--max-restarts=1",
            f"--rdzv-conf={conf}",
            str(JOB),
        ]
        log = open(tmp_path / f"agent-{host}.log", "wb")  # noqa: SIM115 - the child holds it
        return subprocess.Popen(command, env=environ, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            return False

    survivor = agent(1)  # (it hosts the rendezvous store)
    lost: subprocess.Popen[bytes] | None = None
    try:
        wait_for(listening, 120, "the first agent's rendezvous store")
        lost = agent(0)

        def logged(rank: int) -> int:
            path = tmp_path / "progress" / f"rank{rank}"
            return len(path.read_text().split()) if path.exists() else 0

        wait_for(lambda: logged(2) >= 20 and logged(3) >= 20, 180, "ranks 2 and 3 at step 20")
        for pid in [lost.pid, *children(lost.pid)]:
            os.kill(pid, signal.SIGKILL)  # the node is gone: its agent and its workers at once
        lost.wait(30)
        assert survivor.wait(240) == 0, (tmp_path / "agent-1.log").read_text()[-3000:]
    finally:
        for proc in (survivor, lost):
            if proc is not None and proc.poll() is None:
                for pid in [*children(proc.pid), proc.pid]:
                    os.kill(pid, signal.SIGKILL)
                proc.wait(30)
    path = routes.RUN.format(project="faults", run_id=run_id)

    def settled() -> dict[str, Any] | None:
        _, run = call(stack, "GET", path)
        rows = (run.get("watch") or {}).get("findings") or []
        kinds = {f["kind"] for f in rows}
        open_rows = [f for f in rows if f["severity"] != "info"]
        done = {"restarted", "world_size_changed"} <= kinds and run.get("status") == "finished"
        return run if done and not open_rows else None

    run = wait_for(settled, 60, "the restart and the world change, and nothing at warning or above")
    (changed,) = [f for f in run["watch"]["findings"] if f["kind"] == "world_size_changed"]
    assert changed["message"] == "the world changed from 4 to 2 ranks at step 10 (an elastic restart)"
    states = {p["rank"]: (p["state"], p.get("how"), p["attempt"], p["world_size"]) for p in run["processes"]}
    assert states == {
        0: ("ended", "finished", 1, 2),
        1: ("ended", "finished", 1, 2),
        2: ("vanished", None, 0, 4),
        3: ("vanished", None, 0, 4),
    }, states
    posts = [p for p in receiver.posts if p["run_id"] == run_id and p["state"] == "opened"]
    blamed = [
        p["finding"]
        for p in posts
        if p["finding"]["severity"] != "info" and p["finding"].get("rank") in (0, 1)
    ]
    assert blamed == [], blamed
