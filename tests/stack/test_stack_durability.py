"""`instantml local` as users run it, a process on a data directory: what it acknowledged survives a
SIGKILL and a SIGTERM, its replay is a duplicate, and a second stack on the same directory exits at once."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from signal import SIGKILL
from typing import Any

import pytest

from instantml import routes
from tests.faults import FaultServer, free_port, wait_for

PROJECT, RUN = "durable", "r1"
BATCH = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=RUN)


class Stack:
    """One `instantml local` process; its URL and token read from what it prints."""

    def __init__(self, data_dir: Path, port: int, own_group: bool = False) -> None:
        cmd = [
            sys.executable,
            "-m",
            "instantml.cli",
            "local",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ]
        # stderr to a file: a pipe nobody reads while the stack runs fills up and blocks its writers.
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.stderr_path = data_dir.parent / f"stderr-{port}.log"
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=own_group
            )
        self.port = port
        self.token = ""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if "INSTANTML_API_KEY=" in line:
                self.token = line.strip().split("=", 1)[1]
            if line.startswith("Ctrl-C"):
                break
        assert self.token, self.stderr()
        # What it prints from now on is drained, so that a full pipe never holds it up.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        connection.request("POST", BATCH, json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    started: list[Stack] = []
    yield started
    for stack in started:
        stack.stop()


def batch(first_step: int, ranks: int = 50) -> dict[str, Any]:
    return {
        "events": [
            {
                "event_id": secrets.token_hex(16),
                "step": first_step + i // ranks,
                "rank": i % ranks,
                "world_size": ranks,
                "metrics": {"train/loss": 0.1 + i, "x": float("1e-308")},
            }
            for i in range(500)
        ]
    }


def stored_ids(data_dir: Path) -> list[str]:
    from infra.local import database_path
    from shared.store.sqlite import SqliteStore

    return [e.event_id for e in SqliteStore(database_path(data_dir)).read_events(PROJECT, RUN).events]


def test_what_was_acknowledged_before_sigkill_is_there_after_a_restart_and_replays_are_duplicates(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    data_dir, port = tmp_path / "data", free_port()
    first = Stack(data_dir, port)
    stacks.append(first)
    acknowledged: list[dict[str, Any]] = []
    stop = threading.Event()

    def load() -> None:  # posts batches until the stack is gone, keeping what it acknowledged
        step = 0
        while not stop.is_set():
            body = batch(step)
            try:
                status, answer = first.post(body)
            except (OSError, http.client.HTTPException):
                return
            assert status == 200, answer
            assert answer["stored"] == 500, answer
            acknowledged.append(body)
            step += 10

    loader = threading.Thread(target=load)
    loader.start()
    wait_for(lambda: len(acknowledged) >= 5, what="five batches acknowledged")
    os.kill(first.process.pid, signal.SIGKILL)  # mid-stream: a batch may be in flight
    first.process.wait(timeout=30)
    loader.join(timeout=60)
    stop.set()

    # Given a restart on the same directory, when the acknowledged batches are read and replayed:
    second = Stack(data_dir, port)
    stacks.append(second)
    ids = stored_ids(data_dir)
    assert len(ids) == len(set(ids))  # nothing twice
    acked_ids = {e["event_id"] for body in acknowledged for e in body["events"]}
    assert acked_ids <= set(ids)
    for body in acknowledged:
        status, answer = second.post(body)
        assert (status, answer["duplicate"], answer["stored"]) == (200, 500, 0)
    assert second.token == first.token  # the token is kept in the directory: exports stay valid

    # A second stack on a directory in use exits at once and says why.
    third = subprocess.run(
        [sys.executable, "-m", "instantml.cli", "local", "--port", "0", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert third.returncode == 2
    assert "in use" in third.stderr
    assert str(data_dir) in third.stderr

    # SIGTERM stops it cleanly; the data is there on the next start.
    second.process.send_signal(signal.SIGTERM)
    assert second.process.wait(timeout=60) == 0
    third_stack = Stack(data_dir, free_port())
    stacks.append(third_stack)
    assert set(stored_ids(data_dir)) == set(ids)


def test_a_killed_stack_leaves_no_worker_processes_behind(tmp_path: Path, stacks: list[Stack]) -> None:
    stack = Stack(tmp_path / "data", free_port())
    stacks.append(stack)
    status, _ = stack.post(batch(0))
    assert status == 200

    def children() -> set[int]:
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == stack.process.pid:
                    found.add(int(entry.name))
        return found

    workers = wait_for(children, what="the stack's worker processes")
    os.kill(stack.process.pid, signal.SIGKILL)
    stack.process.wait(timeout=30)
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), what="orphaned workers to exit"
    )


def test_a_stack_killed_during_a_sync_loses_nothing_and_the_sync_finishes_after_a_restart(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    import instantml as im

    spool_dir, data_dir, port = tmp_path / "spool", tmp_path / "data", free_port()
    ranks, steps = 8, 5000  # 40,000 events, many batches
    for rank in range(ranks):
        run = im.init(project=PROJECT, run_id="synced", upload_mode="offline", spool_dir=str(spool_dir))
        for step in range(steps):
            run.log_rank_metrics({"train/loss": rank + step / 1e4}, step=step, rank=rank, world_size=ranks)
        run.finish()

    def synced() -> int:
        from infra.local import database_path
        from shared.store.sqlite import SqliteStore

        return len(SqliteStore(database_path(data_dir)).read_events(PROJECT, "synced").events)

    first = Stack(data_dir, port)
    stacks.append(first)
    # The sync talks to the stack through a proxy that holds its requests once 2,000 events are stored,
    # so the kill lands mid-sync however fast the sync is, not when a poll happens to catch it.
    proxy = FaultServer(target=f"http://127.0.0.1:{port}")
    killed = threading.Event()
    proxy.rule = lambda method, path, raw: (
        (0, None) if proxy.stored_upstream >= 2000 and not killed.is_set() else None
    )
    env = dict(os.environ, INSTANTML_API_URL=proxy.url, INSTANTML_API_KEY=first.token)
    sync = subprocess.Popen(
        [sys.executable, "-m", "instantml.cli", "sync", str(spool_dir), "--quiet", "--timeout", "120"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(proxy.held.is_set, what="the sync's request held after 2,000 events were stored")
        stored_before_the_kill = synced()
        assert 2000 <= stored_before_the_kill < ranks * steps, stored_before_the_kill
        os.kill(first.process.pid, SIGKILL)
        first.process.wait(timeout=30)
        # The stack is down: connections are refused, and the held request is answered 503.
        proxy.down()
        killed.set()
        proxy.release.set()
        assert sync.poll() is None, "the sync gave up while the stack was down instead of retrying"

        stacks.append(Stack(data_dir, port))  # same directory, same port, same token
        proxy.up()
        out, err = sync.communicate(timeout=300)
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait(timeout=30)
        proxy.close()
    assert sync.returncode == 0, out + err
    assert synced() == ranks * steps  # every event once: nothing lost, nothing twice


def _group_alive(group: int) -> bool:
    """Whether a process of ``group`` still runs (zombies, which only wait to be reaped, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


@pytest.mark.parametrize(
    "signals", [[signal.SIGINT], [signal.SIGTERM, signal.SIGTERM]], ids=["ctrl-c", "timeout"]
)
def test_a_signal_to_the_whole_process_group_stops_the_stack_cleanly(
    tmp_path: Path, stacks: list[Stack], signals: list[signal.Signals]
) -> None:
    """Ctrl-C in a terminal, `timeout` and process managers signal the stack's whole process group, and
    `timeout` signals it twice. Workers killed that way used to break their pool, and the stack hung in
    its stop for good."""
    stack = Stack(tmp_path / "data", free_port(), own_group=True)
    stacks.append(stack)
    status, _ = stack.post(batch(0))
    assert status == 200
    for sent in signals:
        os.killpg(stack.process.pid, sent)
    try:
        stack.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        # Where the stop waits: the stack prints every thread's stack on SIGUSR1 (infra.local.cli).
        os.kill(stack.process.pid, signal.SIGUSR1)
        wait_for(lambda: "most recent call first" in stack.stderr(), timeout=10, what="the stack's threads")
        pytest.fail(f"the stack did not stop within 60 s; its threads:\n{stack.stderr()[-8000:]}")
    assert stack.process.returncode == 0
    assert "Traceback" not in stack.stderr()
    wait_for(lambda: not _group_alive(stack.process.pid), what="every process of the stack to exit")
    assert len(stored_ids(tmp_path / "data")) == 500
