"""The client against a hostile or unlucky world (issue 28), with real processes: a fake server that
answers each failure mode (``tests.faults.FaultServer`` with a rule: 500 to one request only while it
stores the others; 500 to everything, an outage; 429 with ``Retry-After``; never answering), real spool
writers, the real background uploader, ``instantml sync``, and a spool disk that refuses writes.

The poison rule and the backoff are shortened through their environment variables, so each case takes
a few seconds; every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml.upload import spool, spool_writer, transport
from instantml.upload.background import uploader_running
from tests.faults import FaultServer, wait_for

pytestmark = pytest.mark.client

EVENTS = 200
#: Fast: a request is poison after 3 answers of 500 over 0.5 s while 1 other request succeeded.
FAST = {
    transport.POISON_ATTEMPTS_ENV: "3",
    transport.POISON_SECONDS_ENV: "0.5",
    transport.POISON_SUCCESSES_ENV: "1",
    transport.BACKOFF_MAX_ENV: "0.1",
}
POISON = "poison-\udcff"  # what the config held (a lone surrogate); the fake server fails on it
#: What the client sends of it: a surrogate-escaped byte as ``\xNN`` text (``instantml.run``'s config rule).
POISON_SENT = "poison-\\xff"

TRAIN = textwrap.dedent(
    """
    import os, sys, time, instantml as im
    mode, spool_dir, events = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause = float(os.environ.get("EVENT_PAUSE", "0"))  # the training step's compute, if any
    run = im.init(project="p", run_id="r", upload_mode=mode, spool_dir=spool_dir,
                  config={"output_dir": os.environ.get("CONFIG_VALUE", "ok")})
    for step in range(events):
        run.log_rank_metrics({"train/loss": step / 1000}, step=step, rank=0, world_size=1)
        if pause:
            time.sleep(pause)
    run.finish(timeout=float(os.environ.get("FINISH_TIMEOUT", "30")))
    print("done", flush=True)
    """
)


def _poison_rule(method: str, path: str, raw: bytes) -> tuple[int, str | None] | None:
    """500 to a run update whose config holds the poison value, as the server of issue 28 did."""
    if method == "PATCH" and b"poison-" in raw:
        return 500, None
    return None


@pytest.fixture
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch, server: FaultServer, tmp_path: Path) -> Path:
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INSTANTML_API_URL", server.url)
    monkeypatch.setenv("INSTANTML_API_KEY", "tok")
    spool_dir = tmp_path / "spool"
    monkeypatch.setenv("INSTANTML_SPOOL_DIR", str(spool_dir))
    return spool_dir


def train(mode: str, spool_dir: Path, events: int, **extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **extra)
    args = [sys.executable, "-c", TRAIN, mode, str(spool_dir), str(events)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def sync(spool_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "instantml.cli", "sync", str(spool_dir), "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def set_aside_rows(spool_dir: Path) -> list[dict[str, Any]]:
    try:
        text = (spool_dir / spool.SET_ASIDE).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()]


def configs(server: FaultServer) -> list[object]:
    """The run updates that carry a config or the run's end (not the process records, contract 8)."""
    return [body.get("config", body.get("status")) for _, _, body in server.updates if "process" not in body]


# --- a poison request: set aside, nothing behind it held up ----------------------------------------


@pytest.mark.slow
def test_poison_config_in_thread_mode_holds_up_no_event(
    server: FaultServer, fast: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.rule = _poison_rule
    run = im.init(project="p", run_id="r", upload_mode="thread", config={"output_dir": POISON})
    for step in range(EVENTS):
        run.log_rank_metrics({"train/loss": 1.0}, step=step, rank=0, world_size=1)
    wait_for(lambda: len(server.events) == EVENTS, 20, "every event behind the poison config")
    wait_for(lambda: set_aside_rows(fast), 20, "the poison config to be set aside")
    run.finish(timeout=20)
    (row,) = set_aside_rows(fast)
    assert row["event"]["method"] == "PATCH"
    assert "config" in row["event"]["body"]
    assert "answered HTTP 500" in str(row["reason"])
    assert "other request" in str(row["reason"])
    assert configs(server) == ["finished"]  # the finished mark went; nothing stored was dropped
    assert f"set aside in {fast / spool.SET_ASIDE}" in caplog.text
    assert "--resend-set-aside" in caplog.text
    assert "may be down" not in caplog.text
    _figure("thread", len(server.events))


@pytest.mark.slow
def test_poison_config_in_spool_mode_holds_up_no_event(server: FaultServer, fast: Path) -> None:
    server.rule = _poison_rule
    result = train("spool", fast, EVENTS, CONFIG_VALUE=POISON, FINISH_TIMEOUT="20")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: not uploader_running(fast) and not spool.spool_files(fast), 30, "the uploader to finish")
    assert len(server.events) == EVENTS
    (row,) = set_aside_rows(fast)
    assert "config" in row["event"]["body"]
    assert configs(server) == ["finished"]
    # finish said what was true: set aside (or, if finish came first, waiting while the others go)
    assert "set aside" in result.stderr or "waiting for another attempt" in result.stderr, result.stderr
    assert "may be down" not in result.stderr
    _figure("spool", len(server.events))


@pytest.mark.slow
def test_poison_config_offline_then_sync_stores_every_event_and_sets_it_aside(
    server: FaultServer, fast: Path
) -> None:
    server.rule = _poison_rule
    result = train("offline", fast, EVENTS, CONFIG_VALUE=POISON)
    assert result.returncode == 0, result.stderr
    synced = sync(fast)
    assert synced.returncode == 4, synced.stderr  # set aside: not 0 (not everything is stored)
    assert len(server.events) == EVENTS
    assert configs(server) == ["finished"]
    assert f"1 request(s) set aside in {fast / spool.SET_ASIDE}" in synced.stderr
    assert "answered HTTP 500 to it" in synced.stderr
    assert "--resend-set-aside" in synced.stderr
    assert not spool.spool_files(fast)
    _figure("offline + sync", len(server.events))
    # Once the server is fixed, the request set aside is sent again.
    server.rule = None
    resent = sync(fast, "--resend-set-aside")
    assert resent.returncode == 0, resent.stderr
    assert configs(server) == ["finished", {"output_dir": POISON_SENT}]
    assert not set_aside_rows(fast)


@pytest.mark.slow
def test_a_rejected_run_update_goes_to_the_rejects_file_and_the_queue_moves_on(
    server: FaultServer, fast: Path
) -> None:
    result = train("offline", fast, 50, CONFIG_VALUE="x")
    assert result.returncode == 0
    server.rule = lambda method, path, raw: (400, None) if method == "PATCH" and b"config" in raw else None
    synced = sync(fast)
    assert synced.returncode == 1, synced.stderr
    assert len(server.events) == 50
    assert configs(server) == ["finished"]
    rejects = (fast / spool.REJECTS).read_text().splitlines()
    assert len(rejects) == 1
    assert json.loads(rejects[0])["event"]["method"] == "PATCH"


@pytest.mark.slow
def test_an_outage_sets_nothing_aside_and_loses_nothing(server: FaultServer, fast: Path) -> None:
    result = train("offline", fast, EVENTS)
    assert result.returncode == 0
    down_until = time.monotonic() + 2.0  # 500 to everything for 2 s: far more than 3 attempts over 0.5 s
    server.rule = lambda method, path, raw: (500, None) if time.monotonic() < down_until else None
    synced = sync(fast)
    assert synced.returncode == 0, synced.stderr
    assert server.statuses.count(500) >= 3
    assert not set_aside_rows(fast)
    assert len(server.events) == EVENTS
    assert configs(server) == [{"output_dir": "ok"}, "finished"]  # run updates kept their order


@pytest.mark.slow
def test_429_with_retry_after_is_honoured_and_sets_nothing_aside(server: FaultServer, fast: Path) -> None:
    result = train("offline", fast, EVENTS)
    assert result.returncode == 0
    times: list[float] = []

    def busy(method: str, path: str, raw: bytes) -> tuple[int, str | None] | None:
        times.append(time.monotonic())
        return (429, "1") if len(times) <= 2 else None

    server.rule = busy
    synced = sync(fast)
    assert synced.returncode == 0, synced.stderr
    assert times[1] - times[0] >= 0.75
    assert times[2] - times[1] >= 0.75  # Retry-After: 1 (-20 % jitter)
    assert not set_aside_rows(fast)
    assert len(server.events) == EVENTS


@pytest.mark.slow
def test_a_server_that_never_answers_sets_nothing_aside_and_finish_returns(
    server: FaultServer, fast: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.rule = lambda method, path, raw: (0, None)  # never answers
    run = im.init(project="p", run_id="r", upload_mode="thread")
    run.log_rank_metrics({"train/loss": 1.0}, step=0, rank=0, world_size=1)
    started = time.monotonic()
    run.finish(timeout=1.0)
    assert time.monotonic() - started < 5
    assert "still pending" in caplog.text
    assert "may be down" in caplog.text
    assert not set_aside_rows(fast)


def _figure(mode: str, stored: int) -> None:
    _print_figure(f"events stored after a poison config, {mode} mode: {stored} of {EVENTS}")


def _print_figure(text: str) -> None:
    """A figure of issue 28: printed (seen with ``pytest -s``) and appended to ``$FIGURES_FILE``."""
    line = f"FIGURE {text}\n"
    with open(os.environ.get("FIGURES_FILE", os.devnull), "a") as f:
        f.write(line)
    print(line, end="")


# --- a full spool disk: the uploader survives, one process, no temporary file left ------------------

SHIM = textwrap.dedent(
    """
    # Fault injection for tests only, in the background uploader's process: its progress records and
    # rejects hit ENOSPC until SHIM_ENOSPC_UNTIL (epoch seconds); every uploader process started is
    # recorded in SHIM_PIDS.
    import builtins, errno, os, sys, time
    if "instantml.upload.background" in getattr(sys, "orig_argv", sys.argv):
        with open(os.environ["SHIM_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        until = float(os.environ.get("SHIM_ENOSPC_UNTIL", "0"))
        _open, _write = builtins.open, os.write

        def _full(name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)

        def fake_open(file, mode="r", *args, **kwargs):
            name = str(file) if isinstance(file, (str, os.PathLike)) else ""
            if time.time() < until and ".ack." in name and name.endswith(".tmp") and "w" in mode:
                _open(file, mode, *args, **kwargs).close()  # created, then the write fails: as on a full disk
                _full(name)
            return _open(file, mode, *args, **kwargs)

        def fake_write(fd, data):
            if time.time() < until:
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    target = ""
                if target.endswith(("rejects.jsonl", "set-aside.jsonl")):
                    _full(target)
            return _write(fd, data)

        builtins.open, os.write = fake_open, fake_write
    """
)


def full_disk_run(tmp_path: Path, spool_dir: Path, full_for: float, events: int) -> tuple[list[int], str]:
    """A spool-mode training run whose uploader finds the disk full for ``full_for`` s from the start;
    returns the uploader pids started and finish's stderr."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    pids = tmp_path / "uploader-pids"
    pids.touch()
    env = {
        "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
        "SHIM_PIDS": str(pids),
        "SHIM_ENOSPC_UNTIL": str(time.time() + full_for),
        "FINISH_TIMEOUT": str(full_for + 20),
        "EVENT_PAUSE": str(full_for / events),  # the run goes on for as long as the disk is full
    }
    result = train("spool", spool_dir, events, **env)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir), 60, "the uploader")
    return [int(p) for p in pids.read_text().split()], result.stderr


@pytest.mark.slow
def test_a_full_spool_disk_starts_one_uploader_that_survives_and_leaves_no_temporary_file(
    server: FaultServer, fast: Path, tmp_path: Path
) -> None:
    full_for = float(os.environ.get("FULL_DISK_SECONDS", "3"))
    started, stderr = full_disk_run(tmp_path, fast, full_for, EVENTS)
    assert "Traceback" not in stderr
    assert len(started) == 1, started
    assert len(server.events) == EVENTS
    assert not list(fast.glob("*.tmp")), list(fast.glob("*"))
    log_text = (fast / spool.UPLOADER_LOG).read_text()
    assert "cannot write the progress record" in log_text
    assert "Traceback" not in log_text
    _print_figure(
        f"uploader processes started while the spool disk is full for {full_for:g} s: {len(started)}"
    )


@pytest.mark.slow
def test_stale_temporary_files_are_cleaned_by_sync(server: FaultServer, fast: Path) -> None:
    result = train("offline", fast, 10)
    assert result.returncode == 0
    (path,) = spool.spool_files(fast)
    stale = fast / f"{path.name}.ack.999999.tmp"
    stale.touch()
    assert sync(fast).returncode == 0
    assert not stale.exists()
    assert not list(fast.glob("*.tmp"))


def test_finish_says_when_no_uploader_is_alive(
    server: FaultServer, fast: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An uploader that cannot run (no token in its environment) dies at once; finish restarts it once,
    # then says what is true instead of "the background uploader keeps sending them".
    from instantml.upload import background

    monkeypatch.setattr(background, "start_background", _dead_uploader)
    run = im.init(project="p", run_id="r", upload_mode="spool", spool_dir=fast)
    run.log_rank_metrics({"train/loss": 1.0}, step=0, rank=0, world_size=1)
    run.finish(timeout=5)
    assert "no background uploader is running" in caplog.text
    assert f"instantml sync {fast}" in caplog.text
    assert "keeps sending" not in caplog.text
    assert _dead_uploader.calls <= 2  # type: ignore[attr-defined]


def _dead_uploader(spool_dir: Path, api_url: str, api_key: str) -> subprocess.Popen[bytes]:
    _dead_uploader.calls = getattr(_dead_uploader, "calls", 0) + 1  # type: ignore[attr-defined]
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    return proc


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 72 MiB tmpfs (just above what ``init`` asks to be free), or a skip saying why not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    size = spool_writer.MIN_FREE_BYTES + 8 * 2**20
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a small tmpfs here ({exc}); the shim test above covers the uploader")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); the shim test covers it")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_really_full_spool_disk_mid_run_loses_nothing_and_starts_one_uploader(
    server: FaultServer, fast: Path, tmp_path: Path, small_disk: Path
) -> None:
    full_for = float(os.environ.get("FULL_DISK_SECONDS", "3"))
    spool_dir = small_disk / "spool"
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)  # here it only records the uploader pids
    pids = tmp_path / "uploader-pids"
    pids.touch()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
        SHIM_PIDS=str(pids),
        FINISH_TIMEOUT=str(full_for + 30),
        EVENT_PAUSE=str(2 * full_for / EVENTS),  # the run goes on through the full disk and after it
    )
    args = [sys.executable, "-c", TRAIN, "spool", str(spool_dir), str(EVENTS)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: uploader_running(spool_dir), 30, "init to start the uploader")
        filler = small_disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:  # fill the disk up to the last byte
            for block in (2**20, 4096, 1):
                try:
                    while os.write(fd, b"\0" * block):
                        pass
                except OSError:
                    pass
        finally:
            os.close(fd)
        until = time.monotonic() + full_for
        wait_for(lambda: time.monotonic() >= until, full_for + 5, "the disk to stay full for a while")
        filler.unlink()
        out, err = proc.communicate(timeout=120)
        assert "done" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    wait_for(lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir), 60, "the uploader")
    assert "cannot write to the spool file" in err  # the training process met the full disk too
    assert "Traceback" not in err
    assert "they are lost" not in err
    started = len(pids.read_text().split())
    assert started == 1
    assert len(server.events) == EVENTS
    assert not list(spool_dir.glob("*.tmp"))
    _print_figure(
        f"uploader processes started while a real tmpfs spool disk is full for {full_for:g} s: {started}"
    )
