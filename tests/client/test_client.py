"""The client alone: limits, run ids, modes, and the uploader against a real HTTP server.

These also run under the oldest supported Python (3.10) with nothing but the client installed.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml.run import LAUNCHER_VARIABLES, resolve_run_id
from instantml.upload.spool import spool_files

pytestmark = pytest.mark.client


@pytest.fixture
def disabled() -> im.Run:
    return im.init(project="p", run_id="r", upload_mode="disabled")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 8}, "rank"),
        ({"rank": -1}, "rank"),
        ({"rank": True}, "rank"),
        ({"world_size": 0, "rank": 0}, "world_size"),
        ({"world_size": 513}, "world_size"),
        ({"step": -1}, "step"),
        ({"step": 2**53}, "step"),
        ({"step": 1.5}, "step"),
        ({"local_rank": 8}, "local_rank"),
        ({"weight": -1}, "weight"),
        ({"weight": math.inf}, "weight"),
        ({"weight": "big"}, "weight"),
        ({"metrics": {}}, "metrics"),
        ({"metrics": {f"k{i}": 1.0 for i in range(257)}}, "metrics"),
        ({"metrics": {"x" * 257: 1.0}}, "metrics"),
        ({"metrics": {"bad\nkey": 1.0}}, "metrics"),
        ({"metrics": {" lead": 1.0}}, "metrics"),
        ({"metrics": {"a": "1.0"}}, "metrics['a']"),
        ({"metrics": {"a": True}}, "metrics['a']"),
        ({"metrics": {"a": None}}, "metrics['a']"),
        ({"metrics": [1.0]}, "metrics"),
    ],
)
def test_out_of_limits_raises_value_error_naming_the_argument(
    disabled: im.Run, kwargs: dict[str, Any], field: str
) -> None:
    call: dict[str, Any] = {"metrics": {"train/loss": 1.0}, "step": 1, "rank": 0, "world_size": 8, **kwargs}
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(field)}"):
        disabled.log_rank_metrics(**call)


@pytest.mark.slow
def test_numbers_of_every_kind_and_nonfinite_values_are_accepted_and_sent_as_logged() -> None:
    server = CountingServer()
    try:
        run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok")
        run.log_rank_metrics(
            {
                "a": 1,
                "b": 0.5,
                "c": math.nan,
                "d": -math.inf,
                "eval/acc@1": 1e308,
                "layer.0.attn/grad-norm": 2,
            },
            step=2**53 - 1,
            rank=511,
            world_size=512,
            local_rank=7,
            weight=0,
        )
        run.finish(timeout=30)
        [event] = server.stored.values()
    finally:
        server.server.shutdown()
    assert event["metrics"] == {
        "a": 1.0,
        "b": 0.5,
        "c": "NaN",
        "d": "-Infinity",
        "eval/acc@1": 1e308,
        "layer.0.attn/grad-norm": 2.0,
    }
    assert (event["step"], event["rank"], event["world_size"]) == (2**53 - 1, 511, 512)
    assert (event["local_rank"], event["weight"]) == (7, 0.0)


def test_numpy_scalars_are_accepted_and_sent_as_plain_numbers() -> None:
    np = pytest.importorskip("numpy")
    server = CountingServer()
    try:
        run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok")
        run.log_rank_metrics(
            {"a": np.float32(1.5), "b": np.int64(3)}, step=np.int64(1), rank=np.int32(0), world_size=2
        )
        run.finish(timeout=30)
        [event] = server.stored.values()
    finally:
        server.server.shutdown()
    assert event["metrics"] == {"a": 1.5, "b": 3.0}
    assert (event["step"], event["rank"], event["world_size"]) == (1, 0, 2)


def test_run_id_comes_from_the_environment_in_every_rank() -> None:
    assert resolve_run_id("explicit", {"INSTANTML_RUN_ID": "env"}) == "explicit"
    assert resolve_run_id(None, {"INSTANTML_RUN_ID": "env", "SLURM_JOB_ID": "9"}) == "env"
    assert resolve_run_id(None, {"TORCHELASTIC_RUN_ID": "abc/12", "SLURM_JOB_ID": "9"}) == "abc-12"
    assert resolve_run_id(None, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "9"}) == "9"
    fresh = resolve_run_id(None, {})
    assert fresh.startswith("run-")
    assert fresh != resolve_run_id(None, {})
    with pytest.raises(ValueError, match=r"^run_id"):
        resolve_run_id("no spaces", {})


#: Every variable a launcher may set (the client's own list), cleared so the tests' environment is known.
LAUNCHERS = tuple(name for names in LAUNCHER_VARIABLES.values() for name in names)


def _logged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], **call: Any
) -> dict[str, Any]:
    """What one log_rank_metrics call writes to an offline spool, launched with ``env``."""
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=tmp_path)
    run.log_rank_metrics({"train/loss": 1.0}, step=7, **call)
    run.finish()
    (path,) = spool_files(tmp_path)
    (line,) = [x for x in path.read_text().splitlines() if json.loads(x)["path"].endswith("/rank-metrics")]
    body: dict[str, Any] = json.loads(line)["body"]
    return body


def test_a_launched_process_says_its_host_once_at_init(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run update with this rank's host (findings about the rank name it), once, whatever is logged;
    none without a launcher's rank."""
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    run = im.init(project="p", run_id="r", upload_mode="offline", spool_dir=tmp_path, config={"lr": 1})
    for step in range(3):
        run.log_rank_metrics({"train/loss": 1.0}, step=step)
    run.finish()
    (path,) = spool_files(tmp_path)
    updates = [json.loads(x) for x in path.read_text().splitlines()]
    updates = [u for u in updates if u["method"] == "PATCH" and "process" not in u["body"]]
    assert [u["path"] for u in updates] == ["/v1/projects/p/runs/r"] * 2
    assert updates[0]["body"]["config"] == {"lr": 1} and "hosts" not in updates[0]["body"]
    assert updates[1]["body"]["hosts"] == {"5": socket.gethostname()}  # on its own: see _host_update
    monkeypatch.delenv("RANK")
    run = im.init(project="p", run_id="r2", upload_mode="offline", spool_dir=tmp_path / "b")
    run.log_rank_metrics({"train/loss": 1.0}, step=0, rank=3)
    run.finish()
    (path,) = spool_files(tmp_path / "b")
    assert not any('"hosts"' in x for x in path.read_text().splitlines())


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"},  # torchrun, accelerate, DeepSpeed
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"},
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
        # mpirun inside an sbatch script: the batch step's SLURM_PROCID is 0 on every rank
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        },
    ],
)
def test_rank_world_size_and_local_rank_come_from_the_launcher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]
) -> None:
    body = _logged(monkeypatch, tmp_path, env)
    assert (body["rank"], body["world_size"], body["local_rank"]) == (5, 16, 1)


def test_an_explicit_argument_wins_over_the_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1"}
    body = _logged(monkeypatch, tmp_path, env, rank=2, world_size=4, local_rank=0)
    assert (body["rank"], body["world_size"], body["local_rank"]) == (2, 4, 0)
    body = _logged(
        monkeypatch,
        tmp_path / "b",
        {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "7"},
        rank=0,
        world_size=2,
    )
    assert (body["rank"], body["world_size"], "local_rank" in body) == (
        0,
        2,
        False,
    )  # 7 is not in a world of 2


def test_without_a_launcher_a_missing_rank_names_the_argument_and_the_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(
        ValueError, match=r"^rank: pass rank= or launch .* RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID"
    ):
        _logged(monkeypatch, tmp_path, {})
    with pytest.raises(ValueError, match=r"^world_size: .*WORLD_SIZE / OMPI_COMM_WORLD_SIZE / SLURM_NTASKS"):
        _logged(monkeypatch, tmp_path / "b", {"RANK": "0"})
    rank_events = [
        x for p in spool_files(tmp_path) for x in p.read_text().splitlines() if "/rank-metrics" in x
    ]
    assert rank_events == []


def test_a_launcher_variable_that_is_not_a_number_fails_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match=r"^rank: the launcher's RANK='three' is not a whole number"):
        im.init(project="p", upload_mode="disabled")


def test_init_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INSTANTML_API_URL", raising=False)
    monkeypatch.delenv("INSTANTML_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"^api_url"):
        im.init(project="p")
    with pytest.raises(ValueError, match=r"^api_key"):
        im.init(project="p", api_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"^project"):
        im.init(project="-bad", upload_mode="disabled")
    with pytest.raises(ValueError, match=r"^upload_mode"):
        im.init(project="p", upload_mode="carrier-pigeon")


def test_importing_the_client_loads_no_heavy_dependency() -> None:
    heavy = "('numpy', 'pydantic', 'boto3', 'botocore')"
    code = f"import sys, instantml; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class FlakyServer:
    """A batch endpoint that fails ``failures`` times (503, Retry-After 0) before storing."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.requests = 0
        self.stored: dict[str, dict[str, Any]] = {}
        self.auth: set[str] = set()
        self.patches: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests += 1
                outer.auth.add(self.headers["authorization"])
                if outer.requests <= outer.failures:
                    self.send_response(503)
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    return
                for event in body["events"]:
                    outer.stored.setdefault(event["event_id"], event)
                reply = json.dumps({"results": [], "stored": len(body["events"])}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_PATCH(self) -> None:  # the finished mark at finish()
                outer.patches.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def flaky() -> Iterator[FlakyServer]:
    server = FlakyServer(failures=2)
    yield server
    server.server.shutdown()


@pytest.mark.slow
def test_the_uploader_retries_transient_failures_and_delivers_every_event_once(flaky: FlakyServer) -> None:
    run = im.init(project="p", run_id="r", api_url=flaky.url, api_key="tok", batch_size=10)
    for step in range(25):
        run.log_rank_metrics(
            {"train/loss": step / 10, "bad": math.nan}, step=step, rank=1, world_size=2, weight=3
        )
    run.finish(timeout=60)
    assert flaky.requests >= 5  # 2 failures, then 3 batches of at most 10
    assert len(flaky.stored) == 25
    event = next(e for e in flaky.stored.values() if e["step"] == 7)
    assert event["metrics"] == {"train/loss": 0.7, "bad": "NaN"}
    assert (event["rank"], event["world_size"], event["weight"]) == (1, 2, 3.0)
    assert flaky.auth == {"Bearer tok"}
    # it logged as rank 1: only rank 0 marks the run finished; its process says it started and ended
    assert [p["process"]["state"] for p in flaky.patches] == ["started", "ended"]
    assert flaky.patches[-1]["process"]["how"] == "finished"


@pytest.mark.slow
def test_a_process_that_exits_without_finish_still_sends_what_it_logged(flaky: FlakyServer) -> None:
    """A rank that dies by sys.exit (or reaches the end of its script) in thread mode: its events reach
    the server, and the run is not marked finished (that is rank 0's finish() alone)."""
    code = (
        "import sys, instantml as im\n"
        f"run = im.init(project='p', run_id='r', api_url={flaky.url!r}, api_key='tok')\n"
        "for step in range(40):\n"
        "    run.log_rank_metrics({'train/loss': step}, step=step, rank=0, world_size=2)\n"
        "sys.exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert len(flaky.stored) == 40
    # not marked finished; its process's end says it exited (an atexit hook cannot see the code)
    assert [p["process"]["state"] for p in flaky.patches] == ["started", "ended"]
    assert (flaky.patches[-1]["process"]["how"], flaky.patches[-1]["process"]["code"]) == ("exit", None)


class CountingServer(FlakyServer):
    """A batch endpoint that stores everything and keeps each request's events, in order."""

    def __init__(self) -> None:
        super().__init__(failures=0)


@pytest.mark.slow
def test_events_wait_up_to_the_linger_or_a_full_batch_then_go_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bounds of ``limits.UPLOAD_LINGER_S``: the first request at once, then one per linger or per full
    batch, and what waits goes at finish without waiting."""
    monkeypatch.setenv("INSTANTML_LINGER_S", "0.8")
    server = CountingServer()
    try:
        run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok", batch_size=50)
        run.log_rank_metrics({"loss": 0.0}, step=0, rank=0, world_size=1)
        wait_until(lambda: server.requests == 1)  # the first goes at once (a bad token shows at once)
        started = time.monotonic()
        for step in range(1, 21):  # 20 events over about 0.4 s: fewer than a batch, within the linger
            run.log_rank_metrics({"loss": float(step)}, step=step, rank=0, world_size=1)
            time.sleep(0.02)
        wait_until(lambda: len(server.stored) == 21)
        assert server.requests == 2
        assert time.monotonic() - started >= 0.75  # one request, after the linger
        for step in range(21, 121):  # two full batches go without waiting for the linger
            run.log_rank_metrics({"loss": float(step)}, step=step, rank=0, world_size=1)
        wait_until(lambda: len(server.stored) >= 121, timeout=0.7)
        assert server.requests == 4
        for step in range(121, 131):  # and what waits at finish goes at once
            run.log_rank_metrics({"loss": float(step)}, step=step, rank=0, world_size=1)
        finishing = time.monotonic()
        run.finish(timeout=30)
        assert len(server.stored) == 131
        assert time.monotonic() - finishing < 0.7
    finally:
        server.server.shutdown()


def test_the_linger_is_short_for_a_server_on_this_machine_and_set_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from instantml import limits
    from instantml.upload import transport

    monkeypatch.delenv("INSTANTML_LINGER_S", raising=False)
    assert transport.linger_s("https://abc.execute-api.us-east-1.amazonaws.com") == limits.UPLOAD_LINGER_S
    for local in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert transport.linger_s(local) == limits.UPLOAD_LINGER_LOCAL_S
    monkeypatch.setenv("INSTANTML_LINGER_S", "2.5")
    assert transport.linger_s("https://abc.execute-api.us-east-1.amazonaws.com") == 2.5
    monkeypatch.setenv("INSTANTML_LINGER_S", "nonsense")
    assert transport.linger_s("http://127.0.0.1:8000") == limits.UPLOAD_LINGER_LOCAL_S


@pytest.mark.slow
def test_a_job_s_first_uploads_are_spread_and_the_end_does_not_wait_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank of a big job sends its first request at a random point of the job's spread (here its
    end: 1.5 s), not at once; a run that finishes inside its spread sends everything at once."""
    import random

    from instantml.upload import transport

    monkeypatch.setattr(transport, "first_upload_spread_s", lambda url, world: 1.5 if world == 512 else 60.0)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    monkeypatch.setenv("INSTANTML_LINGER_S", "10")  # as deployed (this machine's linger is 0.25 s)
    server = CountingServer()
    try:
        monkeypatch.setenv("WORLD_SIZE", "512")
        run = im.init(project="p", run_id="r", api_url=server.url, api_key="tok")
        started = time.monotonic()
        run.log_rank_metrics({"loss": 0.0}, step=0, rank=3)
        wait_until(lambda: server.requests + len(server.patches) >= 1)  # its process record, first
        assert time.monotonic() - started >= 1.4
        run.finish(timeout=30)
        monkeypatch.setenv("WORLD_SIZE", "8")  # (the spread patched to a minute)
        run = im.init(project="p", run_id="r2", api_url=server.url, api_key="tok")
        for step in range(5):
            run.log_rank_metrics({"loss": float(step)}, step=step, rank=3)
        finishing = time.monotonic()
        run.finish(timeout=30)
        assert time.monotonic() - finishing < 5  # not the minute
        assert len(server.stored) == 1 + 5
    finally:
        server.server.shutdown()


def test_the_first_uploads_spread_with_the_job_s_size_and_not_for_this_machine() -> None:
    from instantml import limits
    from instantml.upload import transport

    deployed = "https://abc.execute-api.us-east-1.amazonaws.com"
    assert transport.first_upload_spread_s(deployed, 512) == 512 / limits.FIRST_UPLOADS_PER_S
    assert transport.first_upload_spread_s(deployed, 8) == 8 / limits.FIRST_UPLOADS_PER_S
    assert transport.first_upload_spread_s(deployed, 100_000) == limits.FIRST_UPLOAD_SPREAD_MAX_S
    assert transport.first_upload_spread_s(deployed, None) == 0.0
    assert transport.first_upload_spread_s("http://127.0.0.1:8787", 512) == 0.0


def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
