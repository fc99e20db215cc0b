"""Contract 7 end to end on the real local stack: the watch finds what went wrong in live runs of real
rank processes (the client, thread mode), tells a real webhook receiver over HTTP once per onset, keeps
a delivery through a receiver that fails and through a restart of the stack, and ``instantml check``
and ``instantml alerts`` answer from the shell."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from instantml import routes
from tests.faults import Receiver, call, free_port, wait_for

PROJECT = "watch-test"
RANK = textwrap.dedent(
    """
    import sys, time, instantml as im
    run_id, rank, world, steps, stop_at = sys.argv[1], *map(int, sys.argv[2:6])
    with im.init(project="watch-test", run_id=run_id, upload_mode="thread") as run:
        for step in range(steps):
            if step == stop_at:
                sys.exit(0)  # the rank dies: what it logged is sent, the run is not finished by it
            loss = 2.0 / (1 + step) * (1 + 0.01 * ((rank * 7 + step * 3) % 5))
            run.log_rank_metrics({"train/loss": loss, "system/step_time": 0.02}, step, rank, world)
            time.sleep(0.02)
    """
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from infra.local import LocalStack

    data = tmp_path_factory.mktemp("watch-stack")
    running = LocalStack(port=0, data_dir=data, watch_interval=0.5).start()
    try:
        yield running
    finally:
        running.stop()


def job(stack: Any, run_id: str, world: int, steps: int, stopped: dict[int, int] | None = None) -> None:
    """``world`` rank processes logging ``steps`` steps; ``stopped`` rank -> the step it dies at."""
    env = {"INSTANTML_API_URL": stack.url, "INSTANTML_API_KEY": stack.token, "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                run_id,
                str(r),
                str(world),
                str(steps),
                str((stopped or {}).get(r, -1)),
            ],
            env=env,
        )
        for r in range(world)
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 0


def instantml(stack: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"INSTANTML_API_URL": stack.url, "INSTANTML_API_KEY": stack.token, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "instantml.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_stopped_rank_reaches_the_webhook_once_and_a_healthy_run_stays_silent(stack: Any) -> None:
    receiver = Receiver()
    status, body = call(
        stack, "PUT", routes.ALERTS.format(project=PROJECT), {"webhooks": [{"url": receiver.url}]}
    )
    assert status == 200
    assert body == {"webhooks": [{"url": receiver.url, "min_severity": "warning", "last_delivery": None}]}
    job(stack, "healthy", world=4, steps=40)
    job(stack, "faulty", world=4, steps=40, stopped={2: 10})
    (alert,) = wait_for(lambda: receiver.opened("faulty"), timeout=60, what="the faulty run's alert")
    finding = alert["finding"]
    assert (finding["kind"], finding["rank"], finding["severity"]) == ("stopped_reporting", 2, "critical")
    assert alert["text"].startswith(f"CRITICAL {PROJECT}/faulty: rank 2 has not reported since step 9")
    assert alert["url"] == stack.url + routes.DISTRIBUTED_VIEW.format(project=PROJECT, run_id="faulty")
    # Both runs are watched (no tab opened); the healthy one stays silent, the faulty one alerts once.
    wait_for(lambda: len(_runs(stack)) == 2 and all(r["findings"] for r in _runs(stack)), what="both watched")
    runs = {r["run_id"]: r for r in _runs(stack)}
    assert runs["faulty"]["findings"]["critical"] >= 1
    assert runs["faulty"]["headline"] == "rank 2 stopped"
    assert runs["healthy"]["findings"]["critical"] == runs["healthy"]["findings"]["warning"] == 0
    assert runs["healthy"]["headline"] is None
    rounds = _watched_at(stack, "faulty")
    wait_for(lambda: _watched_at(stack, "faulty") > rounds + 1.0, what="more rounds of the watch")
    assert len(receiver.opened("faulty")) == 1
    assert receiver.opened("healthy") == []
    assert len(set(receiver.ids)) == len(receiver.ids)
    # GET .../alerts says how the last POST went.
    alerts = routes.ALERTS.format(project=PROJECT)
    last = wait_for(lambda: call(stack, "GET", alerts)[1]["webhooks"][0]["last_delivery"], what="the note")
    assert (last["state"], last["reason"]) == ("delivered", None)


def _runs(stack: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = call(stack, "GET", routes.RUNS.format(project=PROJECT))[1]["runs"]
    return runs


def _watched_at(stack: Any, run_id: str) -> float:
    record = call(stack, "GET", routes.RUN.format(project=PROJECT, run_id=run_id))[1]
    return float(record["watch"]["watched_at"])


def test_instantml_check_is_a_gate(stack: Any) -> None:
    wait_for(lambda: len(_runs(stack)) == 2 and all(r["findings"] for r in _runs(stack)), what="watched runs")
    faulty = instantml(stack, "check", "--project", PROJECT, "faulty")
    assert faulty.returncode == 1, faulty.stderr
    assert "CRITICAL stopped_reporting · rank 2" in faulty.stdout
    assert "FAIL" in faulty.stdout
    healthy = instantml(stack, "check", "--project", PROJECT, "healthy")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "OK: nothing at or above warning" in healthy.stdout
    unknown = instantml(stack, "check", "--project", PROJECT, "no-such-run")
    assert unknown.returncode == 2
    assert "no run 'no-such-run'" in unknown.stderr
    down = subprocess.run(
        [sys.executable, "-m", "instantml.cli", "check", "--project", PROJECT, "faulty"],
        env={"INSTANTML_API_URL": f"http://127.0.0.1:{free_port()}", "INSTANTML_API_KEY": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 2
    assert "could not reach" in down.stderr


def test_alerts_from_the_shell_and_bad_input_named(stack: Any) -> None:
    project = "alerts-cli"
    listed = instantml(stack, "alerts", "--project", project, "--list")
    assert listed.returncode == 0
    assert "no webhooks" in listed.stdout
    hook = "https://hooks.example/services/T000/B000/XXXX"
    made = instantml(stack, "alerts", "--project", project, "--webhook", hook, "--min-severity", "critical")
    assert made.returncode == 0
    assert f"{hook} (from critical up)" in made.stdout
    assert call(stack, "GET", routes.ALERTS.format(project=project))[1] == {
        "webhooks": [{"url": hook, "min_severity": "critical", "last_delivery": None}]
    }
    bad = instantml(stack, "alerts", "--project", project, "--webhook", "ftp://x")
    assert bad.returncode == 2
    assert "webhooks.0.url" in bad.stderr
    cleared = instantml(stack, "alerts", "--project", project, "--clear")
    assert cleared.returncode == 0
    assert call(stack, "GET", routes.ALERTS.format(project=project))[1] == {"webhooks": []}
    path = routes.ALERTS.format(project=project)
    for body, field in [
        ({"webhooks": [{"url": hook, "min_severity": "loud"}]}, "webhooks.0.min_severity"),
        ({"webhooks": [{"url": hook}] * 9}, "webhooks"),
        ({"webhooks": [{"url": "http://"}]}, "webhooks.0.url"),
        ({"hooks": []}, "hooks"),
    ]:
        status, answer = call(stack, "PUT", path, body)
        assert status == 400, answer
        assert field in [d["field"] for d in answer["error"]["details"]], answer


def test_a_webhook_url_is_the_project_s_secret(stack: Any) -> None:
    from shared.store import open_token_store

    tokens = open_token_store(stack.store_url)
    other, _ = tokens.create("someone-else", "watch test")
    hook = "https://hooks.example/secret-path"
    assert call(stack, "PUT", routes.ALERTS.format(project="owner"), {"webhooks": [{"url": hook}]})[0] == 200
    for method in ("GET", "PUT", "DELETE"):
        body: dict[str, Any] | None = {"webhooks": []} if method == "PUT" else None
        status, answer = call(stack, method, routes.ALERTS.format(project="owner"), body, token=other)
        assert status == 403
        assert "secret-path" not in json.dumps(answer)
    assert call(stack, "GET", routes.ALERTS.format(project="owner"))[1]["webhooks"][0]["url"] == hook


def test_an_alert_survives_a_failing_receiver_and_a_restart_of_the_stack(tmp_path: Path) -> None:
    from infra.local import LocalStack

    receiver = Receiver(fail=1)
    data = tmp_path / "data"
    first = LocalStack(port=0, data_dir=data, watch_interval=0.5).start()
    try:
        path = routes.ALERTS.format(project=PROJECT)
        assert call(first, "PUT", path, {"webhooks": [{"url": receiver.url}]})[0] == 200
        job(first, "restart", world=2, steps=20, stopped={1: 5})
        wait_for(lambda: receiver.attempts >= 1, timeout=60, what="the first attempt (answered 500)")
        receiver.down()  # the retry finds nobody listening
        wait_for(
            lambda: _pending(data) == 1 and _attempts(data) >= 2, timeout=60, what="a second failed attempt"
        )
    finally:
        first.stop()
    assert receiver.posts == []
    assert _pending(data) == 1
    receiver.up()
    second = LocalStack(port=0, data_dir=data, watch_interval=0.5).start()
    try:
        (alert,) = wait_for(
            lambda: receiver.opened("restart"), timeout=90, what="the alert after the restart"
        )
        assert (alert["finding"]["kind"], alert["finding"]["rank"]) == ("stopped_reporting", 1)
        wait_for(lambda: _pending(data) == 0, what="the outbox emptied")
        watched = _watched_at(second, "restart")
        wait_for(lambda: _watched_at(second, "restart") > watched + 1.0, what="more rounds after the restart")
        assert len(receiver.posts) == 1  # delivered once, not decided again after the restart
    finally:
        second.stop()


def _pending(data: Path) -> int:
    from shared.store.sqlite import SqliteStore

    return SqliteStore(data / "instantml.db").pending_deliveries()


def _attempts(data: Path) -> int:
    import sqlite3

    with sqlite3.connect(data / "instantml.db") as conn:
        (attempts,) = conn.execute("SELECT coalesce(max(attempts), 0) FROM outbox").fetchone()
    return int(attempts)


def test_a_failed_end_is_judged_at_once_not_at_the_next_round(tmp_path: Path) -> None:
    """A stack whose watch runs every 10 minutes: a rank's ``ended`` exception (through the real PATCH
    route) nudges the watch, and the alert naming it reaches the webhook within seconds."""
    from infra.local import LocalStack

    stack = LocalStack(port=0, data_dir=tmp_path / "data", watch_interval=600).start()
    receiver = Receiver()
    try:
        assert (
            call(stack, "PUT", routes.ALERTS.format(project=PROJECT), {"webhooks": [{"url": receiver.url}]})[
                0
            ]
            == 200
        )
        run = routes.RUN.format(project=PROJECT, run_id="nudged")
        batch = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id="nudged")
        events = [
            {"event_id": f"{r}-{s}", "step": s, "rank": r, "world_size": 4, "metrics": {"train/loss": 1.0}}
            for s in range(20)
            for r in range(4)
        ]
        assert call(stack, "POST", batch, {"events": events})[0] == 200
        for rank in range(4):
            who = {"rank": rank, "world_size": 4, "pid": 100 + rank}
            assert (
                call(stack, "PATCH", run, {"process": {**who, "state": "started", "first_step": 0}})[0] == 200
            )
        oom = {"type": "RuntimeError", "message": "CUDA out of memory", "where": "train.py:40 forward"}
        ended = {
            "rank": 2,
            "world_size": 4,
            "pid": 102,
            "state": "ended",
            "how": "exception",
            "exception": oom,
        }
        assert call(stack, "PATCH", run, {"process": {**ended, "step": 19}})[0] == 200
        alert = wait_for(
            lambda: next((p for p in receiver.posts if p["finding"]["kind"] == "rank_exited"), None),
            30,
            "the alert naming rank 2, long before the 10-minute round",
        )
        assert alert["finding"]["rank"] == 2 and "CUDA out of memory" in alert["finding"]["message"]
    finally:
        receiver.down()
        stack.stop()
