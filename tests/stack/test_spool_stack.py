"""Spool mode against the real local stack, with real processes and faults in between.

Every request goes through ``tests.faults.FaultServer`` forwarding to the stack, so a test can take the
server down, make it answer 500/429, or hold a batch while the uploader is killed. Each test ends with
the server's own count: the batch answers' ``stored`` add up to exactly the events logged (nothing lost,
nothing stored twice), and the summary has exactly the logged ranks and values at every step.
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
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from instantml import routes
from instantml.upload import spool
from instantml.upload.background import uploader_running
from tests.faults import FaultServer, wait_for

PROJECT = "spool-test"
TRAIN = textwrap.dedent(
    """
    import sys, instantml as im
    run_id, spool_dir = sys.argv[1], sys.argv[2]
    steps, rank, world = (int(a) for a in sys.argv[3:6])
    run = im.init(project="spool-test", run_id=run_id, upload_mode="spool", spool_dir=spool_dir)
    for step in range(steps):
        run.log_rank_metrics({"train/loss": rank + step / 1000}, step=step, rank=rank, world_size=world)
    if sys.argv[6:] == ["hang"]:  # a process that hangs in training until it is killed
        print("logged", flush=True)
        sys.stdin.read()
    run.finish(timeout=1)
    """
)


@pytest.fixture
def proxy(local_stack: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultServer]:
    server = FaultServer(target=local_stack.url)
    monkeypatch.setenv("INSTANTML_API_URL", server.url)
    monkeypatch.setenv("INSTANTML_API_KEY", local_stack.token)
    yield server
    server.close()


def train(
    run_id: str, spool_dir: Path, steps: int, rank: int, world: int, *more: str
) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", TRAIN, run_id, str(spool_dir), str(steps), str(rank), str(world), *more]
    env = dict(os.environ, RANK=str(rank))
    return subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def sync(spool_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "instantml.cli", "sync", str(spool_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def wait_drained(spool_dir: Path, timeout: float = 120) -> None:
    wait_for(
        lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir),
        timeout,
        "the uploader to drain the spool and exit",
    )


def assert_summary_is_exactly(stack: Any, run_id: str, logged: dict[int, int]) -> None:
    """``logged``: rank -> steps 0..n-1 it logged, with ``train/loss`` = rank + step / 1000."""
    last = max(logged.values())
    path = routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id) + f"?max_steps={last}"
    request = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {stack.token}"})

    def counted() -> Any:
        with urllib.request.urlopen(request, timeout=60) as response:
            summary = json.load(response)
        count = summary["reducers"]["train/loss"]["count"]
        expected = [sum(step < n for n in logged.values()) for step in range(last)]
        return summary if count == expected else None

    # A rank whose spool is sent after the others' lands behind the rollups' progress mark: the rollup
    # worker counts it within seconds (README: a late event is counted once the worker has read it).
    summary = wait_for(counted, 60, "every rank's events counted in the summary")
    assert summary["steps"] == list(range(last))
    loss = summary["reducers"]["train/loss"]
    for step in range(last):
        ranks = [r for r, n in logged.items() if step < n]
        assert loss["count"][step] == len(ranks), step
        assert math.isclose(
            loss["mean"][step], sum(r + step / 1000 for r in ranks) / len(ranks), rel_tol=1e-12
        )


def test_server_down_for_10_s_then_up(local_stack: Any, proxy: FaultServer, tmp_path: Path) -> None:
    proxy.hold_next = "POST"
    procs = [train("down", tmp_path, 150, rank, 4) for rank in range(4)]
    wait_for(proxy.held.is_set, 60, "a first batch to arrive")
    proxy.down()  # no new connection gets through from here on (else the uploader may send everything first)
    went_down = time.monotonic()
    proxy.release.set()  # the first batch is answered on the connection it came on
    wait_for(lambda: proxy.statuses, 60, "the first batch to be answered")
    assert [p.wait(60) for p in procs] == [0] * 4  # training is not held up by the server
    wait_for(lambda: time.monotonic() - went_down >= 10, 20, "10 s of downtime")
    assert uploader_running(tmp_path) and spool.spool_files(tmp_path)  # still trying, nothing dropped
    proxy.up()
    wait_drained(tmp_path)
    assert proxy.stored_upstream == 600
    assert_summary_is_exactly(local_stack, "down", dict.fromkeys(range(4), 150))


def test_server_answering_500_and_429_for_a_while(
    local_stack: Any, proxy: FaultServer, tmp_path: Path
) -> None:
    proxy.fail(3, 500, retry_after=None)
    proxy.fail(3, 429, retry_after="1")
    procs = [train("flaky", tmp_path, 100, rank, 2) for rank in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    wait_drained(tmp_path)
    assert proxy.statuses[:6] == [500, 500, 500, 429, 429, 429]
    assert proxy.stored_upstream == 200
    assert_summary_is_exactly(local_stack, "flaky", {0: 100, 1: 100})


def test_kills_a_restart_a_concurrent_sync_and_a_second_replay(
    local_stack: Any, proxy: FaultServer, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    proxy.hold_next = "POST"
    steady = train("crashes", spool_dir, 300, 0, 2)
    doomed = train("crashes", spool_dir, 250, 1, 2, "hang")
    wait_for(proxy.held.is_set, 60, "the uploader's first batch")  # held there: the uploader is stuck
    # kill -9 of a training process; its last write cut short
    assert doomed.stdout is not None and doomed.stdout.readline() == "logged\n"
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(30)
    (doomed_file,) = [p for p in spool.spool_files(spool_dir) if "@rank1@" in p.name]
    with open(doomed_file, "ab") as f:
        f.write(b'{"v":1,"event_id":"torn","method":"PO')
    logged_by_doomed = doomed_file.read_bytes().count(b'"method":"POST"')  # the torn line is cut before
    assert logged_by_doomed == 250
    assert steady.wait(60) == 0  # finish() waited 1 s, said what is pending, and left
    shutil.copytree(spool_dir, tmp_path / "copy", ignore=shutil.ignore_patterns("*.ack", "*.lock", "*.log"))
    # kill -9 of the uploader in the middle of a batch
    os.kill(int((spool_dir / spool.UPLOADER_LOCK).read_text()), signal.SIGKILL)
    wait_for(lambda: not uploader_running(spool_dir), 30, "the uploader to die")
    proxy.release.set()  # the killed uploader's batch goes through; nobody hears the answer
    # a restart, and `instantml sync` while that background uploader runs
    background = subprocess.Popen([sys.executable, "-m", "instantml.upload.background", str(spool_dir)])
    result = sync(spool_dir)
    assert background.wait(120) == 0
    assert result.returncode == 0, result.stderr
    wait_drained(spool_dir)
    assert proxy.stored_upstream == 300 + logged_by_doomed
    # the whole spool replayed again after everything was stored
    again = sync(tmp_path / "copy")
    assert again.returncode == 0, again.stderr
    assert f"duplicate {300 + logged_by_doomed:,}" in again.stderr
    assert proxy.stored_upstream == 300 + logged_by_doomed
    assert_summary_is_exactly(local_stack, "crashes", {0: 300, 1: logged_by_doomed})
