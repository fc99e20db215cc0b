"""A process's records (contract 8), from real processes: a launcher's SIGTERM in thread mode loses none
of the events logged before it and ends the process as it would have ended without the client; a
user's own handler still runs; an exception is recorded with its type, message and frame, and still
printed; a silent main thread beats with its stack; in spool mode the uploader reports a writer that was
SIGKILLed (no record of its own end), once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from instantml.upload import spool
from instantml.upload.background import uploader_running
from tests.faults import FaultServer, wait_for

pytestmark = pytest.mark.slow

#: A training script: STEPS steps logged, then "ready" on stdout, then it waits in `wait_for_data`
#: (or raises, with FAIL=1; or SIGKILLs itself, with KILL=1). MODE: the upload mode. HANDLER=exit7
#: installs a SIGTERM handler of the user's own first.
JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    import instantml as im

    if os.environ.get("HANDLER") == "exit7":
        def mine(signum, frame):
            print("the user's handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)

    def wait_for_data():
        while True:
            time.sleep(0.05)

    run = im.init(project="p", run_id="r", upload_mode=os.environ.get("MODE", "thread"))
    for step in range(int(os.environ["STEPS"])):
        run.log_rank_metrics({"loss": float(step)}, step=step, rank=2, world_size=4)
    if os.environ.get("FAIL"):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\\nmore detail")
    print("ready", flush=True)
    if os.environ.get("KILL"):
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: no handler runs
    wait_for_data()
    """
)


@pytest.fixture
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


def start(server: FaultServer, tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "train_job.py"
    script.write_text(JOB)
    environ = {
        **os.environ,
        "INSTANTML_API_URL": server.url,
        "INSTANTML_API_KEY": "tok",
        "INSTANTML_SPOOL_DIR": str(tmp_path / "spool"),
        # Events wait a minute for more: only the flush at the signal can send them in time.
        "INSTANTML_LINGER_S": "60",
        **env,
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        environ.pop(name, None)
    return subprocess.Popen(
        [sys.executable, str(script)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def records(server: FaultServer) -> list[dict[str, Any]]:
    with server.lock:
        return [body["process"] for _, _, body in server.updates if "process" in body]


def wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", (line, proc.stderr.read() if proc.stderr else "")


def test_sigterm_in_thread_mode_sends_every_event_then_ends_by_the_signal(
    server: FaultServer, tmp_path: Path
) -> None:
    proc = start(server, tmp_path, STEPS="40")
    wait_ready(proc)
    assert len(server.events) < 40  # they wait for the linger
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM  # killed by SIGTERM, as without the client
    assert len(server.events) == 40
    started, ended = records(server)
    assert (started["state"], started["rank"], started["world_size"], started["pid"]) == (
        "started",
        2,
        4,
        proc.pid,
    )
    assert (ended["state"], ended["how"], ended["signal"], ended["step"]) == (
        "ended",
        "signal",
        "SIGTERM",
        39,
    )


def test_a_users_own_sigterm_handler_still_runs_and_sets_the_exit_status(
    server: FaultServer, tmp_path: Path
) -> None:
    proc = start(server, tmp_path, STEPS="10", HANDLER="exit7")
    wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7
    assert proc.stdout is not None and "the user's handler ran" in proc.stdout.read()
    assert len(server.events) == 10
    assert [r.get("how") for r in records(server)] == [None, "signal"]


def test_an_exception_is_recorded_with_where_it_was_raised_and_still_printed(
    server: FaultServer, tmp_path: Path
) -> None:
    proc = start(server, tmp_path, STEPS="5", FAIL="1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: CUDA out of memory" in err  # Python's own hook still printed it
    assert len(server.events) == 5
    ended = records(server)[-1]
    assert ended["how"] == "exception" and ended["step"] == 4
    exception = ended["exception"]
    assert exception["type"] == "RuntimeError"
    assert exception["message"] == "CUDA out of memory. Tried to allocate 2.00 GiB"  # its first line
    assert exception["where"].startswith(str(tmp_path / "train_job.py") + ":")
    assert exception["where"].endswith(" <module>")


def test_a_silent_main_thread_beats_with_its_stack(server: FaultServer, tmp_path: Path) -> None:
    proc = start(server, tmp_path, STEPS="3", INSTANTML_BEAT_S="0.5", INSTANTML_LINGER_S="0")
    try:
        wait_ready(proc)
        beats = wait_for(
            lambda: [r for r in records(server) if r["state"] == "beat"][:2],
            30,
            "two beats of the silent process",
        )
        first = beats[0]
        assert first["step"] == 2 and first["silent_s"] >= 0.5 and first["every"] == 0.5
        assert any(line.endswith(" wait_for_data") for line in first["stack"]), first["stack"]
        assert first["stack"][-1].endswith(" wait_for_data")  # innermost last: time.sleep is C
    finally:
        proc.kill()
        proc.wait(30)


def test_the_uploader_reports_a_sigkilled_writer_once_dated_at_its_last_write(
    server: FaultServer, tmp_path: Path
) -> None:
    proc = start(server, tmp_path, STEPS="40", MODE="spool", KILL="1", INSTANTML_LINGER_S="0")
    wait_ready(proc)
    assert proc.wait(30) == -signal.SIGKILL
    killed_at = time.time()
    spool_dir = tmp_path / "spool"
    wait_for(lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir), 60, "the drain")
    assert len(server.events) == 40
    with server.lock:
        bodies = [body for _, _, body in server.updates if "process" in body]
    assert [(b["process"]["state"], b["process"].get("how")) for b in bodies] == [
        ("started", None),
        ("ended", "vanished"),
    ]
    gone = bodies[-1]
    assert {k: gone["process"][k] for k in ("rank", "world_size", "pid", "step")} == {
        "rank": 2,
        "world_size": 4,
        "pid": proc.pid,
        "step": 39,
    }
    assert gone["time"] <= killed_at  # its last write, not when the uploader noticed
    assert "reported as vanished" in (spool_dir / spool.UPLOADER_LOG).read_text()


def _line(event_id: str, method: str, path: str, body: dict[str, Any]) -> str:
    return json.dumps({"v": 1, "event_id": event_id, "method": method, "path": path, "body": body}) + "\n"


def test_a_restarted_uploader_reports_a_writer_from_its_file_and_never_a_resend_or_a_finished_one(
    server: FaultServer, tmp_path: Path
) -> None:
    """The lines of a dead writer's file were all sent by an uploader before this one (its progress
    record says so): this one reads the file's process records again and reports it, once, dated at the
    file's last write. A resend of set-aside requests (``resend@``: its started record is someone
    else's) and a writer that recorded its end are never reported."""
    from instantml.upload.replay import Replayer

    run = "/v1/projects/p/runs/r"
    who = {"rank": 3, "world_size": 8, "pid": 4242, "attempt": 0}
    started = {"process": {**who, "state": "started", "first_step": 0}, "time": 1.0}
    dead = tmp_path / "p@r@h@pid4242@rank3@abc123.jsonl"
    dead.write_text(
        _line("a" * 32, "PATCH", run, started)
        + _line(
            "b" * 32, "POST", run + "/rank-metrics", {"step": 7, "rank": 3, "world_size": 8, "metrics": {}}
        )
    )
    spool.write_ack(dead, dead.stat().st_size)  # sent, by an uploader gone since
    os.utime(dead, (1000.0, 1000.0))
    resend = tmp_path / "resend@h@pid99@def456.jsonl"
    resend.write_text(
        _line("c" * 32, "PATCH", run, {**started, "process": {**who, "rank": 5, "state": "started"}})
    )
    finished = tmp_path / "p@r@h@pid77@rank1@fed321.jsonl"
    done = {"process": {**who, "rank": 1, "pid": 77, "state": "ended", "how": "finished"}, "time": 2.0}
    finished.write_text(
        _line(
            "d" * 32, "PATCH", run, {**started, "process": {**who, "rank": 1, "pid": 77, "state": "started"}}
        )
        + _line("e" * 32, "PATCH", run, done)
    )
    Replayer(tmp_path, server.url, "tok").drain_all()
    assert spool.spool_files(tmp_path) == []
    with server.lock:
        reports = [b for _, _, b in server.updates if b["process"].get("how") == "vanished"]
    assert reports == [{"process": {**who, "state": "ended", "how": "vanished"}, "time": 1000.0}]
    # The same dead file again (a sync and the uploader both reached it): the same event, stored once.
    dead.write_text(_line("a" * 32, "PATCH", run, started))
    Replayer(tmp_path, server.url, "tok").drain_all()
    with server.lock:
        ids = [k for _, k, b in server.updates if b["process"].get("how") == "vanished"]
    assert len(ids) == 2 and len(set(ids)) == 1, ids


def test_instantml_check_groups_the_processes_by_what_they_said_the_one_that_went_first_on_top() -> None:
    """512 ranks are a few lines: a silent one first, then the ended in the order they ended (the one that
    raised, with its message), the ranks the launcher ended after it as spans."""
    from instantml.commands.watching import process_lines

    exception = {"type": "RuntimeError", "message": "CUDA out of memory", "where": "train.py:40 forward"}
    rows: list[dict[str, Any]] = [
        {"rank": r, "state": "ended", "ended": 20.0, "how": "signal", "signal": "SIGTERM", "restarts": 0}
        for r in range(512)
    ]
    rows[300] = {"rank": 300, "state": "ended", "ended": 10.0, "how": "exception", "exception": exception}
    rows[300]["restarts"] = 1
    rows[7] = {"rank": 7, "state": "silent", "stack": ["train.py:9 main", "data.py:3 load"], "restarts": 0}
    assert process_lines({"processes": rows}) == [
        "processes (512, 1 restarted):",
        "  rank 7: silent, in data.py:3 load",
        "  rank 300: ended: exception RuntimeError at train.py:40 forward: CUDA out of memory",
        "  ranks 0-6, 8-299, 301-511: ended: signal SIGTERM",
    ]
    assert process_lines({"processes": []}) == process_lines({}) == []
    many = [{"rank": r, "state": "ended", "ended": r, "how": "exit", "code": r} for r in range(20)]
    assert process_lines({"processes": many})[-1] == "  ... and 12 more group(s)"
