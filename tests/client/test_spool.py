"""Spool mode with real processes: the writer, the background uploader, ``instantml sync``, and faults.

The server is ``tests.faults.FaultServer``: a batch route that stores each event id once (stdlib only,
so these run with nothing but the client installed, on Python 3.10 too).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml import limits
from instantml.upload import spool, spool_writer
from instantml.upload.background import uploader_running
from tests.faults import FaultServer, free_port, update_kinds, wait_for

pytestmark = pytest.mark.client

TRAIN = textwrap.dedent(
    """
    import os, sys, instantml as im
    mode, spool_dir = sys.argv[1], sys.argv[2]
    steps, rank, world = (int(a) for a in sys.argv[3:6])
    run = im.init(project="p", run_id="r", upload_mode=mode, spool_dir=spool_dir)
    for step in range(steps):
        run.log_rank_metrics({"train/loss": rank + step / 1000, "odd": float("nan")}, step=step, rank=rank,
                             world_size=world, local_rank=rank, weight=2)
        if step == 0:
            print("logging", flush=True)
    run.finish(timeout=float(os.environ.get("FINISH_TIMEOUT", "60")))
    print("done", flush=True)
    """
)


@pytest.fixture
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture
def env(server: FaultServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("INSTANTML_API_URL", server.url)
    monkeypatch.setenv("INSTANTML_API_KEY", "tok")
    return dict(os.environ)


def train(
    mode: str, spool_dir: Path, steps: int, rank: int = 0, world: int = 1, **extra: str
) -> subprocess.Popen[str]:
    env = dict(os.environ, RANK=str(rank), **extra)
    args = [sys.executable, "-c", TRAIN, mode, str(spool_dir), str(steps), str(rank), str(world)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sync(spool_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "instantml.cli", "sync", str(spool_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def spool_lines(spool_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for path in spool.spool_files(spool_dir) for line in path.read_text().splitlines()
    ]


def wait_drained(spool_dir: Path) -> None:
    """The background uploader has left (lock free) and the spool holds no event file any more."""
    wait_for(
        lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir),
        90,
        "the uploader to drain the spool and exit",
    )


def test_the_spool_holds_one_json_request_event_per_call(tmp_path: Path, env: dict[str, str]) -> None:
    proc = train("offline", tmp_path, 5, rank=3, world=4)
    assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    (path,) = spool.spool_files(tmp_path)
    project, run_id, host, pid, rank, _ = path.name.removesuffix(".jsonl").split("@")
    assert (project, run_id, pid, rank) == ("p", "r", f"pid{proc.pid}", "rank3")
    assert host
    everything = spool_lines(tmp_path)
    assert len({e["event_id"] for e in everything}) == len(everything) == 8
    # This process's records (contract 8) travel in the same spool: started before its first event,
    # ended (finished) after its last.
    records = [e for e in everything if "process" in e["body"]]
    assert [e["body"]["process"]["state"] for e in records] == ["started", "ended"]
    started, ended = (e["body"]["process"] for e in records)
    assert (started["rank"], started["world_size"], started["pid"], started["first_step"]) == (
        3,
        4,
        proc.pid,
        0,
    )
    assert (ended["how"], ended["step"]) == ("finished", 4)
    assert everything.index(records[0]) < min(i for i, e in enumerate(everything) if e["method"] == "POST")
    lines = [e for e in everything if "process" not in e["body"]]
    host_line, *events = lines  # the rank's host first, once (see test_client), then one line per call
    assert (host_line["method"], host_line["path"]) == ("PATCH", "/v1/projects/p/runs/r")
    assert list(host_line["body"]["hosts"]) == ["3"]
    first = events[0]
    assert set(first) == {"v", "event_id", "method", "path", "body", "created"}
    assert (first["v"], first["method"], first["path"]) == (1, "POST", "/v1/projects/p/runs/r/rank-metrics")
    assert first["body"]["metrics"] == {"train/loss": 3.0, "odd": "NaN"}
    assert {k: first["body"][k] for k in ("step", "rank", "world_size", "local_rank", "weight")} == {
        "step": 0,
        "rank": 3,
        "world_size": 4,
        "local_rank": 3,
        "weight": 2.0,
    }
    assert spool.read_config(tmp_path) == {"api_url": env["INSTANTML_API_URL"]}  # never the token
    assert "tok" not in "".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())


def test_finish_in_offline_mode_says_where_the_events_are_and_how_to_send_them(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """With no logging configured (a plain training script), the user sees it on stderr."""
    proc = train("offline", tmp_path, 5)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # its host, its started record, 5 rank events, its ended record and rank 0's finished mark
    assert f"9 event(s) of this process are in the spool {tmp_path}" in err
    assert f"upload them with: instantml sync {tmp_path}\n" in err
    no_url = dict(env, INSTANTML_API_URL="")  # nothing tells sync where to send them: it says so
    done = subprocess.run(
        [sys.executable, "-c", TRAIN, "offline", str(tmp_path / "b"), "1", "0", "1"],
        env=no_url,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"instantml sync {tmp_path / 'b'} --api-url URL" in done.stderr


@pytest.mark.slow
def test_spool_mode_uploads_from_another_process_exactly_once(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    procs = [train("spool", tmp_path, 300, rank=r, world=3) for r in range(3)]
    assert [p.wait(90) for p in procs] == [0, 0, 0]
    wait_drained(tmp_path)
    assert len(server.events) == 900
    assert {(e["step"], e["rank"]) for e in server.events.values()} == {
        (s, r) for s in range(300) for r in range(3)
    }
    assert server.auth == {"Bearer tok"}
    assert "started" in (tmp_path / spool.UPLOADER_LOG).read_text()


@pytest.mark.slow
def test_sync_replays_once_and_again_without_storing_twice(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    assert train("offline", tmp_path / "s", 120).wait(60) == 0
    shutil.copytree(tmp_path / "s", tmp_path / "copy")
    assert server.requests == 0  # offline: nothing is sent until sync
    first = sync(tmp_path / "s")
    assert first.returncode == 0, first.stderr
    # 120 rank events; the rank's host, its process's start and end (contract 8) and rank 0's
    # finished mark at finish(), counted apart
    assert "120/120 events" in first.stderr
    assert "run updates 4" in first.stderr
    assert "every event is stored" in first.stderr
    assert len(server.events) == 120
    assert spool.spool_files(tmp_path / "s") == []
    assert sorted(update_kinds(server)) == ["ended finished", "finished", "hosts", "started"]
    again = sync(tmp_path / "copy")  # the whole spool replayed after everything was stored
    assert again.returncode == 0, again.stderr
    assert "duplicate 120" in again.stderr
    assert len(server.events) == 120


@pytest.mark.slow
def test_sync_exit_codes_name_rejects_and_what_is_pending(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=tmp_path)
    for step in range(10):
        run.log_rank_metrics(
            {"train/loss": 1.0} if step != 4 else {"reject-me": 1.0}, step=step, rank=0, world_size=1
        )
    run.finish()
    server.down()
    down = sync(tmp_path, "--timeout", "1")
    assert down.returncode == 3
    # and the process's start and end and the finished mark
    assert "10 event(s) and 3 run update(s) still in" in down.stderr
    server.up()
    done = sync(tmp_path)
    assert done.returncode == 1, done.stderr
    assert str(tmp_path / "rejects.jsonl") in done.stderr
    (reject,) = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert reject["error"]["message"] == "metrics: reject-me is not welcome"
    assert reject["event"]["body"]["step"] == 4
    assert len(server.events) == 9


@pytest.mark.slow
def test_sync_against_a_server_that_is_down_says_it_is_retrying_and_where(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    assert train("offline", tmp_path, 10).wait(60) == 0
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = sync(tmp_path, "--api-url", url, "--timeout", "2", "--quiet")
    assert result.returncode == 3, result.stderr
    update = f"{url}/v1/projects/p/runs/r"  # the rank's host comes first, then the batch
    attempts = [line for line in result.stderr.splitlines() if line.startswith("instantml sync: attempt")]
    assert attempts, result.stderr
    assert all(update in line and "ConnectionRefusedError" in line for line in attempts)
    assert "attempt 1 at" in attempts[0]
    assert "retrying in" in attempts[0]
    assert "giving up in" in attempts[0]
    final = result.stderr.splitlines()[-1]
    assert final.startswith("not everything was sent: 10 event(s) and 4 run update(s) still in")
    assert update in final
    assert final.endswith(f"to try again: instantml sync {tmp_path}")
    assert server.requests == 0


def _sync_process(spool_dir: Path, *args: str) -> subprocess.Popen[str]:
    """``instantml sync`` as a terminal starts it: SIGINT at its default (Python turns it into
    KeyboardInterrupt), whatever the test runner's own disposition is."""
    cmd = [sys.executable, "-m", "instantml.cli", "sync", str(spool_dir), *args]
    return subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_line(proc: subprocess.Popen[str], text: str) -> list[str]:
    """stderr lines up to the first holding ``text`` (the process's own --timeout bounds the wait)."""
    assert proc.stderr is not None
    lines: list[str] = []
    while not lines or text not in lines[-1]:
        line = proc.stderr.readline()
        assert line, "".join(lines)  # stderr closed: the process ended without saying it
        lines.append(line)
    return lines


@pytest.mark.slow
def test_ctrl_c_during_sync_says_what_is_safe_in_the_spool_and_exits_130(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=tmp_path)
    steps = 2 * limits.MAX_BATCH_EVENTS + 500  # three batches, then the finished mark
    for step in range(steps):
        run.log_rank_metrics({"train/loss": 1.0}, step=step, rank=0, world_size=1)
    run.finish()
    server.hold_next = "POST"
    proc = _sync_process(tmp_path, "--timeout", "60")
    wait_for(server.held.is_set, 60, "the first batch")
    server.down()  # the first batch is answered; the second finds nobody
    server.release.set()
    _wait_for_line(proc, "instantml sync: attempt 1 at")
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, rest
    assert "Traceback" not in rest
    # Failed attempts the sync reported before the signal reached it (other batches', or a retry
    # under load) may come first; the interruption's summary is the last line.
    *attempts, summary = rest.splitlines()
    assert all(line.startswith("instantml sync: attempt ") for line in attempts), rest
    left = steps - limits.MAX_BATCH_EVENTS
    assert summary == (  # after the batches: the process's end and the finished mark
        f"instantml sync: interrupted; {left:,} event(s) and 2 run update(s) are still in "
        f"{tmp_path}, safe on disk ({limits.MAX_BATCH_EVENTS:,} stored by this sync); "
        f"resume with: instantml sync {tmp_path}"
    )
    server.up()
    resumed = sync(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{left:,}/{left:,} events" in resumed.stderr
    assert len(server.events) == steps


@pytest.mark.slow
def test_transient_errors_are_retried_honouring_retry_after(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    assert train("offline", tmp_path, 50).wait(60) == 0
    server.fail(2, 500, retry_after=None)
    server.fail(2, 429, retry_after="0")
    server.fail(1, 503, retry_after="1")
    result = sync(tmp_path, "--quiet")
    assert result.returncode == 0, result.stderr
    assert server.statuses[:5] == [500, 500, 429, 429, 503]
    assert len(server.events) == 50


@pytest.mark.slow
def test_a_training_process_killed_mid_run_leaves_a_readable_spool(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    proc = train("offline", tmp_path, 10_000_000)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "logging\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    (path,) = spool.spool_files(tmp_path)
    # the kill may itself have cut the last line short (a buffer flushed mid-line): only whole lines count
    whole = path.read_bytes().rpartition(b"\n")[0]
    logged = whole.count(b'"method":"POST"')
    with open(path, "ab") as f:  # what a write cut short by the kill leaves: part of a line
        f.write(b'{"v":1,"event_id":"torn","method":"POST","pa')
    result = sync(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1 torn last line(s) ignored" in result.stderr
    assert len(server.events) == logged > 0
    # the rank's host and its process's start; killed, it wrote no end: the sync reports it vanished
    assert sorted(update_kinds(server)) == ["ended vanished", "hosts", "started"]
    assert "is gone without recording its end: reported as vanished" in result.stderr


@pytest.mark.slow
def test_an_uploader_killed_mid_batch_is_replaced_and_nothing_is_lost(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    server.hold_next = "POST"
    proc = train("spool", tmp_path, 400, FINISH_TIMEOUT="120")
    wait_for(server.held.is_set, 60, "the uploader's first batch")
    pid = int((tmp_path / spool.UPLOADER_LOCK).read_text())
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not uploader_running(tmp_path), 30, "the uploader to die")
    server.release.set()  # the killed uploader's batch reaches the server; its answer is lost
    assert proc.wait(150) == 0  # finish() starts a new uploader, which resends from the last ack
    wait_drained(tmp_path)
    assert len(server.events) == 400
    assert "uploader" in (tmp_path / spool.UPLOADER_LOG).read_text()


@pytest.mark.slow
def test_two_uploaders_and_a_sync_on_one_spool_store_everything_once(
    tmp_path: Path, server: FaultServer, env: dict[str, str]
) -> None:
    for rank in range(2):
        assert train("offline", tmp_path, 1500, rank=rank, world=2).wait(60) == 0
    cmd = [sys.executable, "-m", "instantml.upload.background", str(tmp_path)]
    uploaders = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    result = sync(tmp_path)
    outs = [u.communicate(timeout=120)[1] for u in uploaders]
    assert [u.returncode for u in uploaders] == [0, 0]
    assert sum("another uploader holds" in out for out in outs) <= 1
    assert result.returncode == 0, result.stderr
    assert len(server.events) == 3000
    assert not spool.spool_files(tmp_path)


def test_an_unusable_spool_directory_fails_at_init(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"^spool_dir: cannot use"):
        im.init(project="p", upload_mode="spool", spool_dir=blocker / "spool")
    monkeypatch.setattr(spool_writer, "MIN_FREE_BYTES", 2**62)
    with pytest.raises(OSError, match=r"^spool_dir: .* free"):
        im.init(project="p", upload_mode="offline", spool_dir=tmp_path / "spool")


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, instantml as im
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=sys.argv[1])
    for step in range(200):
        run.log_rank_metrics({"train/loss": 0.5}, step=step, rank=0, world_size=1)
    run.finish()
    print("training went on", flush=True)
    """
)


def test_a_full_disk_mid_training_does_not_crash_it(tmp_path: Path, env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "training went on" in result.stdout, result.stderr
    assert "cannot write to the spool file" in result.stderr
    assert "they are lost" in result.stderr
    # only whole lines: a short write is cut back off
    events = [e for e in spool_lines(tmp_path) if e["method"] == "POST"]
    assert 0 < len(events) < 200
    assert [e["body"]["step"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    "metrics",
    [
        {"a": 0.1, "b": 1 / 3, "tiny": 5e-324, "huge": 1.7976931348623157e308, "neg": -0.0, "int": 2**53 + 1},
        {"a": 0.1, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "ключ/é": 2.5},
    ],
)
def test_spooled_values_keep_full_float64_precision(tmp_path: Path, metrics: dict[str, float]) -> None:
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=tmp_path)
    run.log_rank_metrics(metrics, step=1, rank=0, world_size=1, weight=0.1 + 0.2)
    run.finish()
    (event,) = [e for e in spool_lines(tmp_path) if e["method"] == "POST"]  # (and the finished mark)
    back = {
        k: limits.NONFINITE_STRINGS[v] if isinstance(v, str) else v
        for k, v in event["body"]["metrics"].items()
    }
    assert set(back) == set(metrics)
    for key, value in metrics.items():
        want = float(value)  # ints are converted with float(), as the contract says
        got = back[key]
        assert (math.isnan(want) and math.isnan(got)) or (got == want and type(got) is float)
        assert math.copysign(1, got) == math.copysign(1, want)
    assert event["body"]["weight"] == 0.1 + 0.2


@pytest.mark.slow
def test_the_uploader_lets_a_live_writer_s_lines_wait_up_to_the_linger_or_the_size_bound(
    tmp_path: Path, server: FaultServer
) -> None:
    """The bounds of ``limits.UPLOAD_LINGER_S`` in spool mode: the first request at once, then a live
    writer's lines wait for the linger or ``UPLOAD_BATCH_BYTES``; a writer gone sends what is left at once."""
    import time

    from instantml.upload.replay import Replayer

    writer = spool_writer.SpoolWriter(tmp_path, "p", "r")
    replayer = Replayer(tmp_path, server.url, "tok", linger_s=0.6)

    def log(steps: range) -> None:
        for step in steps:
            writer.log({"train/loss": float(step)}, step, 0, 1, None, 1.0)

    log(range(3))
    assert replayer.drain(writer.path)
    assert len(server.events) == 3  # nothing taken yet: at once
    log(range(3, 10))
    assert not replayer.drain(writer.path)
    assert len(server.events) == 3  # the writer lives: they wait
    time.sleep(0.65)
    assert replayer.drain(writer.path)
    assert len(server.events) == 10  # they waited the linger
    big = writer.path.stat().st_size
    one_line = big // 10
    log(range(10, 10 + limits.UPLOAD_BATCH_BYTES // one_line + 1))  # the size bound, before the linger
    assert replayer.drain(writer.path)
    assert len(server.events) > 10 + limits.UPLOAD_BATCH_BYTES // one_line - 5
    requests = server.requests
    log(range(5000, 5005))
    assert not replayer.drain(writer.path)
    writer.close()  # the writer is gone: what it wrote goes at once, and its file is done
    assert replayer.drain(writer.path)
    assert server.requests == requests + 1
    assert not writer.path.exists()
