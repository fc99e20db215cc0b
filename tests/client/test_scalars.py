"""``run.log`` scalars, ``im.init(config=...)`` and the finished mark of ``run.finish()``, in every sink.

The server is ``tests.faults.FaultServer`` (stdlib only: these run on Python 3.10 with nothing but the
client installed). It keeps rank events, scalars and run updates apart and lists every call in order.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml import limits
from instantml.run import LAUNCHER_VARIABLES, check_config
from instantml.upload import replay, spool
from tests.faults import FaultServer, calls_named, update_kinds, wait_for

pytestmark = pytest.mark.client

#: Every variable a launcher may set (the client's own list), cleared so the tests' environment is known.
LAUNCHERS = tuple(name for names in LAUNCHER_VARIABLES.values() for name in names)
RUN_PATH = "/v1/projects/p/runs/r"


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single process unless a test sets a launcher's variables."""
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture
def disabled() -> im.Run:
    return im.init(project="p", run_id="r", upload_mode="disabled")


def lines(spool_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for path in spool.spool_files(spool_dir) for line in path.read_text().splitlines()
    ]


def offline(spool_dir: Path, **kwargs: Any) -> im.Run:
    return im.init(project="p", run_id="r", upload_mode="offline", spool_dir=spool_dir, **kwargs)


# --- limits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"step": -1}, "step"),
        ({"step": 2**53}, "step"),
        ({"step": 1.5}, "step"),
        ({"step": True}, "step"),
        ({"metrics": {}}, "metrics"),
        ({"metrics": {f"k{i}": 1.0 for i in range(257)}}, "metrics"),
        ({"metrics": {"x" * 257: 1.0}}, "metrics"),
        ({"metrics": {"bad\nkey": 1.0}}, "metrics"),
        ({"metrics": {"trail ": 1.0}}, "metrics"),
        ({"metrics": {"a": "1.0"}}, "metrics['a']"),
        ({"metrics": {"a": True}}, "metrics['a']"),
        ({"metrics": {"a": None}}, "metrics['a']"),
        ({"metrics": [("a", 1.0)]}, "metrics"),
    ],
)
def test_run_log_out_of_limits_raises_value_error_naming_the_argument(
    disabled: im.Run, kwargs: dict[str, Any], field: str
) -> None:
    call: dict[str, Any] = {"metrics": {"train/loss": 1.0}, "step": 1, **kwargs}
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        disabled.log(**call)


def test_run_log_takes_numbers_of_every_kind_and_nonfinite_values(tmp_path: Path) -> None:
    run = offline(tmp_path)
    run.log({"lr": 3e-4})
    run.log({"a": 1, "b": 0.5, "nan": math.nan, "-inf": -math.inf, "eval/acc@1": 1e308}, step=2**53 - 1)
    with pytest.raises(ValueError, match=r"^step: must be between 0 and 9007199254740991"):
        run.log({"lr": 3e-4})  # the default step after the last one allowed
    run.finish()
    first, last = (line["body"] for line in lines(tmp_path) if line["path"].endswith("/scalars"))
    assert (first["step"], first["metrics"]) == (0, {"lr": 3e-4})
    assert last["step"] == 2**53 - 1
    assert last["metrics"] == {"a": 1, "b": 0.5, "nan": "NaN", "-inf": "-Infinity", "eval/acc@1": 1e308}


def test_a_launcher_rank_over_the_limit_names_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "600")
    run = im.init(project="p", upload_mode="disabled")
    with pytest.raises(ValueError, match=r"^rank: "):
        run.log({"a": 1.0})


def test_config_is_checked_and_made_json_ready(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^config: must be a dict"):
        im.init(project="p", upload_mode="disabled", config=[("lr", 1.0)])  # type: ignore[arg-type]
    big = {"blob": "x" * limits.MAX_CONFIG_BYTES}
    with pytest.raises(ValueError, match=r"^config: is 65,547 bytes as compact JSON, more than .*65,536"):
        im.init(project="p", upload_mode="disabled", config=big)
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match=r"^config: nests deeper than"):
        check_config(loop)
    assert check_config({"blob": "x" * (limits.MAX_CONFIG_BYTES - 11)})  # exactly 64 KiB is allowed

    class Opt:
        def __str__(self) -> str:
            return "AdamW"

    got = check_config(
        {
            "lr": 1e-3,
            "betas": (0.9, 0.95),
            "clip": math.inf,
            "nan": math.nan,
            3: None,
            "opt": Opt(),
            "on": True,
        }
    )
    assert got == {
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "clip": "Infinity",
        "nan": "NaN",
        "3": None,
        "opt": "AdamW",
        "on": True,
    }


def test_numpy_values_in_config_become_numbers() -> None:
    np = pytest.importorskip("numpy")
    assert check_config({"lr": np.float32(0.5), "n": np.int64(3), "w": np.zeros(2)}) == {
        "lr": 0.5,
        "n": 3,
        "w": "[0. 0.]",
    }


# --- the spool ------------------------------------------------------------------------------------


def test_the_default_step_follows_the_last_logged_one(tmp_path: Path) -> None:
    run = offline(tmp_path)
    run.log({"a": 1.0})
    run.log({"a": 1.0})
    run.log({"a": 1.0}, step=10)
    with pytest.raises(ValueError, match=r"^metrics"):
        run.log({})  # a refused call does not move the step
    run.log({"a": 1.0})
    run.log({"a": 1.0}, step=5)  # backwards: the next default follows it
    run.log({"a": 1.0})
    run.finish()
    steps = [e["body"]["step"] for e in lines(tmp_path) if e["method"] == "POST"]
    assert steps == [0, 1, 10, 11, 5, 6]


def test_spool_lines_of_scalars_config_and_finish(tmp_path: Path) -> None:
    run = offline(tmp_path, config={"lr": 0.001, "model": "gpt2", "clip": math.inf})
    run.log({"train/loss": 0.12, "odd": math.nan, "lr": 1e-3})
    run.log_rank_metrics({"x": 1.0}, step=0, rank=0, world_size=1)
    run.finish()
    config, scalars, rank_event, finished = [e for e in lines(tmp_path) if "process" not in e["body"]]
    for line in (config, scalars, rank_event, finished):
        assert set(line) == {"v", "event_id", "method", "path", "body", "created"}
        assert line["v"] == 1
    assert len({line["event_id"] for line in (config, scalars, rank_event, finished)}) == 4
    assert (config["method"], config["path"]) == ("PATCH", RUN_PATH)
    assert set(config["body"]) == {"config", "time"}
    assert config["body"]["config"] == {"lr": 0.001, "model": "gpt2", "clip": "Infinity"}
    assert (scalars["method"], scalars["path"]) == ("POST", RUN_PATH + "/scalars")
    assert set(scalars["body"]) == {"step", "rank", "metrics", "time"}
    assert scalars["body"]["metrics"] == {"train/loss": 0.12, "odd": "NaN", "lr": 1e-3}
    assert (scalars["body"]["step"], scalars["body"]["rank"]) == (0, 0)
    assert scalars["body"]["time"] == scalars["created"]
    assert isinstance(scalars["body"]["time"], float)
    assert rank_event["path"] == RUN_PATH + "/rank-metrics"
    assert (finished["method"], finished["path"], finished["body"]["status"]) == (
        "PATCH",
        RUN_PATH,
        "finished",
    )
    assert set(finished["body"]) == {"status", "time"}


def test_set_config_sends_a_config_after_init_in_order_with_the_events(tmp_path: Path) -> None:
    run = offline(tmp_path, config={"lr": 0.1})
    run.log({"a": 1.0})
    run.set_config({"lr": 0.2, "betas": (0.9, 0.95)})  # a trainer's hyperparameters, known later
    with pytest.raises(ValueError, match=r"^config: must be a dict"):
        run.set_config([("lr", 1.0)])  # type: ignore[arg-type]
    run.finish()
    with pytest.raises(RuntimeError, match="finished"):
        run.set_config({"lr": 0.3})
    first, scalars, second, finished = lines(tmp_path)
    assert (first["method"], first["path"], first["body"]["config"]) == ("PATCH", RUN_PATH, {"lr": 0.1})
    assert scalars["method"] == "POST"
    assert (second["method"], second["path"]) == ("PATCH", RUN_PATH)
    assert set(second["body"]) == {"config", "time"}
    assert second["body"]["config"] == {"lr": 0.2, "betas": [0.9, 0.95]}
    assert finished["body"]["status"] == "finished"
    disabled = im.init(project="p", upload_mode="disabled")
    disabled.set_config({"lr": 1.0})  # a no-op, still checked
    with pytest.raises(ValueError, match=r"^config: is .* bytes"):
        disabled.set_config({"blob": "x" * limits.MAX_CONFIG_BYTES})


@pytest.mark.slow
def test_thread_mode_sends_set_config_between_init_and_finish(server: FaultServer) -> None:
    run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok", config={"lr": 0.1})
    run.set_config({"lr": 0.2})
    run.finish(timeout=60)
    assert [body.get("config", body.get("status")) for _, _, body in server.updates] == [
        {"lr": 0.1},
        {"lr": 0.2},
        "finished",
    ]


def test_names_in_the_run_path_are_quoted(tmp_path: Path) -> None:
    run = im.init(project="p", run_id="a.b_c-1", upload_mode="offline", spool_dir=tmp_path, config={})
    run.log({"a": 1.0})
    run.finish()
    assert [e["path"] for e in lines(tmp_path)] == [
        "/v1/projects/p/runs/a.b_c-1",
        "/v1/projects/p/runs/a.b_c-1/scalars",
        "/v1/projects/p/runs/a.b_c-1",
    ]


@pytest.mark.parametrize(("env", "marked"), [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False)])
def test_finish_marks_the_run_finished_only_on_rank_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], marked: bool
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = offline(tmp_path, config={"lr": 0.1})  # config: from every process that passes one
    run.log({"a": 1.0})
    run.finish()
    run.finish()  # twice: nothing more
    got = lines(tmp_path)
    assert [e["body"].get("config") for e in got if e["method"] == "PATCH" and "config" in e["body"]] == [
        {"lr": 0.1}
    ]
    assert [e["body"] for e in got if e["method"] == "PATCH" and "status" in e["body"]] == (
        [{"status": "finished", "time": got[-1]["body"]["time"]}] if marked else []
    )
    assert [e["body"]["rank"] for e in got if e["method"] == "POST"] == [int(env.get("RANK", "0"))]


@pytest.mark.parametrize(("rank", "marked"), [(0, True), (3, False)])
def test_without_a_launcher_the_rank_a_process_logs_as_decides_whether_finish_marks_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, marked: bool
) -> None:
    run = offline(tmp_path)  # no launcher variable is set (the autouse fixture)
    run.log_rank_metrics({"x": 1.0}, step=0, rank=rank, world_size=8)  # ranks passed by hand
    run.finish()
    assert any("status" in e["body"] for e in lines(tmp_path) if e["method"] == "PATCH") is marked


def test_a_with_block_left_by_an_exception_does_not_mark_the_run_finished(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), offline(tmp_path / "crash") as run:
        run.log({"a": 1.0})
        raise RuntimeError("training crashed")
    assert [e["method"] for e in lines(tmp_path / "crash")] == ["POST"]
    with offline(tmp_path / "ok") as run:
        run.log({"a": 1.0})
    assert [e["method"] for e in lines(tmp_path / "ok")] == ["POST", "PATCH"]
    with pytest.raises(RuntimeError, match="finished"):
        run.log({"a": 1.0})


def test_disabled_mode_checks_and_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = im.init(project="p", upload_mode="disabled", config={"lr": 0.1})
    run.log({"a": 1.0})
    run.log({"a": 1.0}, step=3)
    with pytest.raises(ValueError, match=r"^step"):
        run.log({"a": 1.0}, step=-1)
    run.finish()
    assert list(tmp_path.iterdir()) == []


# --- replay: the uploader and instantml sync ---------------------------------------------------------


@pytest.mark.slow
def test_the_thread_uploader_sends_one_batch_per_route_when_a_rank_logs_both_kinds(
    server: FaultServer,
) -> None:
    server.down()  # everything is logged before the first send that can succeed
    run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok")
    for step in range(10):
        run.log_rank_metrics({"loss": 1.0}, step=step, rank=0, world_size=1)
        run.log({"train/loss": 1.0})
    server.up()
    run.finish(timeout=60)
    batch, scalars_batch = RUN_PATH + "/rank-metrics/batch", RUN_PATH + "/scalars/batch"
    # between the process's start and end records (contract 8), one batch per route
    assert calls_named(server) == [
        ("PATCH", "started"),
        ("POST", batch),
        ("POST", scalars_batch),
        ("PATCH", "ended finished"),
        ("PATCH", "finished"),
    ]
    assert (len(server.events), len(server.scalars)) == (10, 10)


@pytest.mark.slow
def test_the_replayer_sends_each_kind_to_its_route_one_batch_each_between_run_updates(
    tmp_path: Path, server: FaultServer
) -> None:
    run = offline(tmp_path, config={"lr": 0.1})
    for step in range(3):
        run.log_rank_metrics({"loss": 1.0}, step=step, rank=0, world_size=1)
    run.log({"train/loss": 0.5})
    run.log({"train/loss": 0.4, "lr": math.nan})
    run.log_rank_metrics({"loss": 1.0}, step=3, rank=0, world_size=1)
    run.finish()
    ids = [e["event_id"] for e in lines(tmp_path)]
    replayer = replay.Replayer(tmp_path, server.url, "tok")
    for path in spool.spool_files(tmp_path):
        replayer.drain(path)
    batch, scalars_batch = RUN_PATH + "/rank-metrics/batch", RUN_PATH + "/scalars/batch"
    # Rank events and scalars interleaved in the file are one batch per route (not one per run of a
    # kind: a rank that logs both would send every event alone); run updates stay where they were.
    assert calls_named(server) == [
        ("PATCH", "config"),
        ("PATCH", "started"),
        ("POST", batch),
        ("POST", scalars_batch),
        ("PATCH", "ended finished"),
        ("PATCH", "finished"),
    ]
    # each run update sent with its own line's id as its Idempotency-Key
    assert [(key, kind) for (_, key, _), kind in zip(server.updates, update_kinds(server), strict=True)] == [
        (ids[0], "config"),
        (ids[1], "started"),
        (ids[-2], "ended finished"),
        (ids[-1], "finished"),
    ]
    assert sorted(e["metrics"]["train/loss"] for e in server.scalars.values()) == [0.4, 0.5]
    assert {e["event_id"] for e in server.scalars.values()} == set(ids[5:7])
    assert next(e for e in server.scalars.values() if e["step"] == 1)["metrics"]["lr"] == "NaN"
    assert len(server.events) == 4
    assert (replayer.stored, replayer.updated, replayer.rejected) == (6, 4, 0)
    assert spool.spool_files(tmp_path) == []  # acknowledged and removed


@pytest.mark.slow
def test_sync_records_rejects_of_every_kind_and_sends_what_follows(
    tmp_path: Path, server: FaultServer
) -> None:
    run = offline(tmp_path, config={"reject-me": 1})  # the server answers 400 to this run update
    run.log({"train/loss": 0.5})
    run.log({"reject-me": 1.0})  # rejected within its batch
    run.log({"train/loss": 0.3})
    run.finish()
    (path,) = spool.spool_files(tmp_path)
    with open(path, "a") as f:  # a request this client never sends
        f.write(
            json.dumps({"v": 1, "event_id": "x", "method": "DELETE", "path": RUN_PATH, "body": {}}) + "\n"
        )
    env = dict(os.environ, INSTANTML_API_URL=server.url, INSTANTML_API_KEY="tok")
    cmd = [sys.executable, "-m", "instantml.cli", "sync", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert str(tmp_path / spool.REJECTS) in result.stderr
    rejects = [json.loads(line) for line in (tmp_path / spool.REJECTS).read_text().splitlines()]
    assert [(r["event"]["method"], r["error"]["code"]) for r in rejects] == [
        ("PATCH", "invalid_request"),
        ("POST", "invalid_request"),
        ("DELETE", "unreadable_line"),
    ]
    assert rejects[0]["error"]["message"] == "reject-me: not welcome"
    assert "not a request event this client sends: DELETE" in rejects[2]["error"]["message"]
    assert sorted(e["metrics"]["train/loss"] for e in server.scalars.values()) == [0.3, 0.5]
    assert [body["status"] for _, _, body in server.updates] == ["finished"]
    assert server.calls == [("PATCH", RUN_PATH), ("POST", RUN_PATH + "/scalars/batch"), ("PATCH", RUN_PATH)]
    assert spool.spool_files(tmp_path) == []


def test_a_refused_token_on_a_run_update_stops_the_replay(tmp_path: Path, server: FaultServer) -> None:
    run = offline(tmp_path, config={"lr": 0.1})
    run.log({"a": 1.0})
    run.finish()
    server.fail(1, 401)
    replayer = replay.Replayer(tmp_path, server.url, "tok")
    (path,) = spool.spool_files(tmp_path)
    with pytest.raises(replay.Stop, match="refuses"):
        replayer.drain(path)
    assert spool.read_ack(path) == 0
    assert server.calls == [("PATCH", RUN_PATH)]


@pytest.mark.slow
def test_run_updates_are_retried_like_batches(tmp_path: Path, server: FaultServer) -> None:
    run = offline(tmp_path, config={"lr": 0.1})
    run.finish()
    server.fail(2, 503)
    replayer = replay.Replayer(tmp_path, server.url, "tok")
    replayer.drain_all()  # a failed update waits for its next attempt: drain again until settled
    assert server.statuses == [503, 503, 200, 200]
    assert [body.get("config") for _, _, body in server.updates] == [{"lr": 0.1}, None]


@pytest.mark.slow
def test_spool_mode_uploads_scalars_config_and_the_finished_mark(
    tmp_path: Path, server: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INSTANTML_API_KEY", "tok")
    run = im.init(
        project="p", run_id="r", upload_mode="spool", spool_dir=tmp_path, api_url=server.url, config={}
    )
    for _ in range(50):
        run.log({"train/loss": 0.5})
    run.finish(timeout=60)  # returns once everything is acknowledged; the uploader then removes the file
    wait_for(lambda: not spool.spool_files(tmp_path), 30, "the uploader to remove the finished spool file")
    assert sorted(e["step"] for e in server.scalars.values()) == list(range(50))
    assert [body.get("config", body.get("status")) for _, _, body in server.updates] == [{}, "finished"]
    assert server.calls[0][0] == server.calls[-1][0] == "PATCH"


# --- the in-process thread uploader ------------------------------------------------------------------


@pytest.mark.slow
def test_thread_mode_sends_every_kind_in_order(server: FaultServer) -> None:
    run = im.init(
        project="p", run_id="r", api_url=server.url, api_key="tok", batch_size=4, config={"lr": 0.1}
    )
    for step in range(6):
        run.log_rank_metrics({"loss": 1.0}, step=step, rank=0, world_size=1)
        run.log({"train/loss": step / 10})
    run.log({"reject-me": 1.0})  # a reject does not stop the others
    run.log({"train/loss": 9.0})
    run.finish(timeout=60)
    assert len(server.events) == 6
    assert sorted(e["step"] for e in server.scalars.values()) == [*range(6), 7]
    assert next(e for e in server.scalars.values() if e["step"] == 3)["metrics"] == {"train/loss": 0.3}
    assert {e["rank"] for e in server.scalars.values()} == {0}
    assert [
        body.get("config", body.get("status")) for _, _, body in server.updates if "process" not in body
    ] == [
        {"lr": 0.1},
        "finished",
    ]
    calls = calls_named(server)
    assert calls[:2] == [("PATCH", "config"), ("PATCH", "started")]
    assert calls[-2:] == [("PATCH", "ended finished"), ("PATCH", "finished")]
    assert all(len(key) == 32 for _, key, _ in server.updates)  # each with its own Idempotency-Key
    assert {c[1] for c in calls[2:-2]} == {
        RUN_PATH + "/rank-metrics/batch",
        RUN_PATH + "/scalars/batch",
    }


@pytest.mark.slow
def test_thread_mode_records_a_refused_run_update_and_goes_on(server: FaultServer) -> None:
    run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok", config={"reject-me": True})
    run.log({"a": 1.0})
    uploader = run._sink
    run.finish(timeout=60)
    assert len(server.scalars) == 1
    assert [body.get("status") for _, _, body in server.updates] == ["finished"]
    assert [r["error"]["code"] for r in uploader.rejected] == ["invalid_request"]  # type: ignore[union-attr]
