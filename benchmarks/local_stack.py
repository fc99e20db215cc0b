"""`instantml local` against its floors and against MLflow, side by side in one run (issue 13's figures).

    .venv/bin/python -m benchmarks.local_stack [--quick] [--figures ingest,sync,...] [--rounds 3]
                                               [--clients 4] [--no-mlflow]

One rank event: a random 128-bit hex ``event_id``, step, rank, ``world_size=64``, weight, time and 4
float64 metrics. A run logs 64 ranks per step; requests carry 1,000 events. Every server is a process of
its own on 127.0.0.1 and a free port, fed by the same ``--clients`` keep-alive ``http.client`` threads
(bodies encoded before the clock starts); every process started here is stopped by its pid.

1. ``ingest``: events/s through HTTP, interleaved per round, each variant on a fresh store:
   floor 1, bare ``sqlite3`` (WAL, ``synchronous=NORMAL``, 1,000-row transactions, ``INSERT ... ON
   CONFLICT DO NOTHING RETURNING`` row by row on a table with a unique index on (project, run,
   event_id); a row's keys as one string, its values packed as float64; rows made before the clock);
   floor 2, a stdlib ``ThreadingHTTPServer`` process doing ``json.loads`` + that insert and answering
   the batch route's per-event results; ours, ``instantml local``; MLflow's tracking server on SQLite
   (``log-batch`` of 1,000 metric values, that is 250 rank events of 4 values), from
   ``.cache/venv-mlflow`` (made here when missing), twice: with the rank in the key
   (``train/loss/rank07``: the per-rank view users would want, 256 keys a run) and with the rank
   dropped (4 keys; MLflow has no rank dimension). The goal is against the faster one.
2. ``sync``: ``instantml sync`` of a spool of 200,000 events written by the client in offline mode.
3. ``summary``: ``GET .../distributed?keys=<2 keys>`` of a 64 x 1,000 run, alone and with 50 other runs
   of that size stored (loaded through the batch route; their load rate is printed too). The reference is
   the floor of a summary: the same rows read from bare ``sqlite3`` (an index on project, run, step) and
   decoded into numpy, with mean and std per step.
4. ``p99``: latency of single 1,000-event batches sent one at a time, alone and while another thread
   asks for summaries of a 64 x 1,000 run in a loop.
5. ``rss``: the stack's RSS (VmRSS summed over its process tree; VmHWM for the peak) after 2,000,000
   events, beside the same stack idle right after start.
6. ``restart``: from process start to the first authenticated GET answered 200, on the directory of
   figure 5 (2,000,000 events) beside the same on a directory with only the probe's 64 events.

``--quick`` shrinks every size for a smoke run (the figures then say little). Full sizes take about an hour
on 2 cores: MLflow's rounds (2 x 200,000 events at 1,000-3,000 events/s), and loading 5.3 M events
through HTTP for figures 3 and 5.
A fresh stack's first request starts its function pools (seconds): figure 1 sends one step per client
before its clock starts, figure 2 one step before its rounds; figure 6 counts it, as a user waits for it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import math
import os
import queue
import random
import re
import secrets
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.drivers import QuietHandler, in_threads  # noqa: E402
from instantml import routes  # noqa: E402

MLFLOW_VENV = ROOT / ".cache" / "venv-mlflow"
MLFLOW_REQUIREMENTS = ("mlflow==3.17.*", "mlflow>=3.17,<4")  # the pin, then the nearest available
MLFLOW_METRICS_PER_REQUEST = 1000  # MLflow's limit for log-batch
PROJECT = "bench"
RANKS = 64
BATCH = 1000
KEYS = ("train/loss", "optimizer/grad_norm", "perf/step_time_s", "memory/allocated_gib")
SUMMARY_KEYS = KEYS[:2]
FIGURES = ("ingest", "sync", "summary", "p99", "rss", "restart")

# Issue 13's goals on this 2-core machine, and its references measured on a quiet one.
GOAL_INGEST = 12_000
GOAL_VS_MLFLOW = 4.0
GOAL_SYNC = 5_000
GOAL_SUMMARY_S = 0.3
GOAL_CROWDED = 1.2
GOAL_P99 = 2.0
GOAL_RSS_MIB = 512
GOAL_RESTART_S = 2.0
QUIET = {"floor 1": "about 45,000", "floor 2": "about 33,000", "mlflow": "about 2,700"}


@dataclass(frozen=True)
class Sizes:
    ingest_events: int
    sync_events: int
    summary_steps: int
    other_runs: int
    p99_batches: int
    big_events: int
    rounds: int


FULL = Sizes(200_000, 200_000, 1_000, 50, 200, 2_000_000, 3)
QUICK = Sizes(5_000, 2_000, 50, 2, 5, 10_000, 1)


@dataclass
class Context:
    sizes: Sizes
    rounds: int
    clients: int
    workdir: Path
    mlflow: bool
    data_dir_flag: bool  # whether this checkout's `instantml local` takes --data-dir
    ours_ingest: float | None = None
    big_dir: Path | None = None  # a stack directory holding sizes.big_events events and the probe run
    tokens: dict[Path, str] = dataclasses.field(default_factory=dict)  # one per stack directory


# The workload ------------------------------------------------------------------------------------


def run_events(run: str, steps: Iterable[int], seed: int = 0) -> Iterator[dict[str, Any]]:
    """64 ranks per step, 4 keys; deterministic for (run, seed), so floors and stacks get the same rows."""
    rng = random.Random(f"{run}/{seed}")
    for step in steps:
        for rank in range(RANKS):
            noise = rng.random()
            yield {
                "event_id": f"{rng.getrandbits(128):032x}",
                "step": step,
                "rank": rank,
                "world_size": RANKS,
                "weight": 1024.0,
                "time": 1_764_672_000.0 + step * 0.25 + rank * 1e-3,
                "metrics": {
                    KEYS[0]: 2.4 / (1 + step / 60) + 0.2 + 0.01 * noise,
                    KEYS[1]: 3.0 + 0.3 * rng.random(),
                    KEYS[2]: 0.25 + 0.005 * noise,
                    KEYS[3]: 21.5 + rank / 64,
                },
            }


def chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def batch_path(run: str) -> str:
    return routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run)


def summary_path(run: str, keys: Sequence[str] = SUMMARY_KEYS) -> str:
    query = urllib.parse.urlencode({"keys": ",".join(keys)})
    return routes.DISTRIBUTED.format(project=PROJECT, run_id=run) + "?" + query


def batch_body(events: list[dict[str, Any]]) -> bytes:
    return json.dumps({"events": events}).encode()


def run_batches(run: str, steps: int, seed: int = 0) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """A whole run as batch requests, encoded lazily (by the sending thread) to load large stores."""
    path = batch_path(run)
    for chunk in chunks(run_events(run, range(steps), seed), BATCH):
        yield path, lambda chunk=chunk: batch_body(chunk)


def floor_row(run: str, event: dict[str, Any]) -> tuple[Any, ...]:
    return (
        PROJECT,
        run,
        event["event_id"],
        event["step"],
        event["rank"],
        event["world_size"],
        event.get("weight", 1.0),
        event.get("time", 0.0),
        "\n".join(event["metrics"]),
        array("d", event["metrics"].values()).tobytes(),
    )


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# The floors: bare sqlite3, and a bare stdlib HTTP server around it -----------------------------

FLOOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    project TEXT NOT NULL, run TEXT NOT NULL, event_id TEXT NOT NULL, step INTEGER NOT NULL,
    rank INTEGER NOT NULL, world_size INTEGER NOT NULL, weight REAL NOT NULL, time REAL NOT NULL,
    keys TEXT NOT NULL, vals BLOB NOT NULL
);
"""
FLOOR_ID_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS events_id ON events (project, run, event_id)"
FLOOR_STEP_INDEX = "CREATE INDEX IF NOT EXISTS events_step ON events (project, run, step)"
FLOOR_INSERT = (
    "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING event_id"
)


def floor_db(path: Path, indexes: Sequence[str] = (FLOOR_ID_INDEX,)) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(FLOOR_SCHEMA)
    for index in indexes:
        db.execute(index)
    return db


def floor_insert(db: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> list[bool]:
    """One transaction; per row, True when stored and False when its id was already there."""
    db.execute("BEGIN")
    try:
        stored = [db.execute(FLOOR_INSERT, row).fetchone() is not None for row in rows]
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return stored


def serve_floor(db_path: str, token: str) -> None:
    """Floor 2 (run as a process of its own): the batch route, its auth header, ``json.loads`` and
    :func:`floor_insert`, answering the per-event results the real route answers."""
    from http.server import ThreadingHTTPServer

    db = floor_db(Path(db_path))
    lock = threading.Lock()
    expected = f"Bearer {token}"

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Authorization") != expected:
                return self.reply(401, {"error": {"code": "unauthorized", "message": "bad token"}})
            parts = self.path.split("/")  # /v1/projects/{project}/runs/{run_id}/rank-metrics/batch
            project, run = parts[3], parts[5]
            events = json.loads(body)["events"]
            rows = [floor_row(run, event) for event in events]
            with lock:
                stored = floor_insert(db, [(project, *row[1:]) for row in rows])
            results = [
                {"event_id": e["event_id"], "status": "stored" if s else "duplicate"}
                for e, s in zip(events, stored, strict=True)
            ]
            n = sum(stored)
            self.reply(200, {"results": results, "stored": n, "duplicate": len(events) - n, "rejected": 0})

        def reply(self, status: int, document: dict[str, Any]) -> None:
            self.send(status, json.dumps(document).encode(), "application/json")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"floor server on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


def floor_summary(db: sqlite3.Connection, run: str, steps: int) -> np.ndarray:
    """The floor of a summary: read a run's rows in a step window, decode 2 keys into ranks x steps
    matrices (the values are stored packed, a row's keys as one string), and reduce per step (mean
    and std)."""
    rows = db.execute(
        "SELECT rank, step, keys, vals FROM events WHERE project = ? AND run = ? AND step BETWEEN ? AND ?",
        (PROJECT, run, 0, steps - 1),
    ).fetchall()
    assert len(rows) == RANKS * steps, len(rows)
    by_keys: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in rows:
        by_keys[row[2]].append(row)
    matrices = {key: np.full((RANKS, steps), np.nan) for key in SUMMARY_KEYS}
    for keys, group in by_keys.items():
        names = keys.split("\n")
        values = np.frombuffer(b"".join(row[3] for row in group), "<f8").reshape(len(group), len(names))
        ranks = np.fromiter((row[0] for row in group), np.int64, len(group))
        at_steps = np.fromiter((row[1] for row in group), np.int64, len(group))
        for key in SUMMARY_KEYS:
            if key in names:
                matrices[key][ranks, at_steps] = values[:, names.index(key)]
    return np.stack([np.stack([m.mean(axis=0), m.std(axis=0)]) for m in matrices.values()])


def floor_store_runs(db: sqlite3.Connection, runs: Sequence[str], steps: int) -> None:
    """Bulk-load whole runs for the read floor (not timed): plain inserts, then the indexes."""
    for run in runs:
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (floor_row(run, e) for e in run_events(run, range(steps))),
        )
        db.execute("COMMIT")
    db.execute(FLOOR_STEP_INDEX)
    db.execute(FLOOR_ID_INDEX)


# Processes: started here, stopped here by pid ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state on (index 1 is the parent's pid, 19 the start time)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, str]:
    """``root`` and all its descendants, each with its start time (to never signal a reused pid)."""
    children: dict[int, list[int]] = defaultdict(list)
    starts: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
            children[int(fields[1])].append(int(entry.name))
            starts[int(entry.name)] = fields[19]
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in starts:
            tree[pid] = starts[pid]
            todo.extend(children[pid])
    return tree


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Proc:
    """A process this benchmark started, its stdout read line by line (never left to fill the pipe)."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = cwd / f"stderr-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log
        )
        self.pid = self.popen.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url, self.token = "", ""

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.decode(errors="replace"))
        self.lines.put(None)

    def wait_for(self, patterns: dict[str, str], timeout: float = 120.0) -> dict[str, str]:
        """The first group of each regex in ``patterns``, from the process's stdout."""
        found: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(patterns):
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"{self.describe()}: nothing matching {patterns} in {timeout:.0f} s"
                ) from None
            if line is None:
                raise RuntimeError(f"{self.describe()} exited ({self.popen.wait()}): {self.stderr_tail()}")
            for name, pattern in patterns.items():
                if name not in found and (match := re.search(pattern, line)):
                    found[name] = match.group(1)
        return found

    def describe(self) -> str:
        return " ".join(Path(a).name if a.startswith("/") else a for a in self.cmd[:4])

    def stderr_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def rss_mib(self) -> tuple[float, float, int]:
        """VmRSS and VmHWM (peak) summed over the process tree, in MiB, and the number of processes."""
        tree = process_tree(self.pid)
        rss = sum(_status_kib(pid, "VmRSS") for pid in tree) / 1024
        peak = sum(_status_kib(pid, "VmHWM") for pid in tree) / 1024
        return rss, peak, len(tree)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the process (SIGKILL after ``timeout``), then the same to any descendant left."""
        family = process_tree(self.pid) if self.popen.poll() is None else {}
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [
                p for p, start in family.items() if p != self.pid and (f := proc_stat(p)) and f[19] == start
            ]
            left = [p for p in left if (proc_stat(p) or ["Z"])[0] != "Z"]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5
            while left and time.monotonic() < deadline:
                left = [p for p in left if (f := proc_stat(p)) and f[19] == family[p] and f[0] != "Z"]
                time.sleep(0.05)
        self._log.close()


def child_env() -> dict[str, str]:
    """This checkout's code first (not the one the dev venv was installed from), output unbuffered."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def stack_takes_data_dir() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "instantml.cli", "local", "--help"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "--data-dir" in out


def start_stack(
    ctx: Context, data_dir: Path, port: int = 0, token: str | None = None, wait: bool = True
) -> Proc:
    """``instantml local`` on ``data_dir``; ready once it printed its URL and token (``wait``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    token = token or ctx.tokens.setdefault(data_dir, secrets.token_urlsafe(24))
    cmd = [sys.executable, "-m", "instantml.cli", "local", "--host", "127.0.0.1", "--port", str(port)]
    cmd.append(f"--token={token}")  # one argument: a token may start with "-"
    if ctx.data_dir_flag:
        cmd += ["--data-dir", str(data_dir)]
    proc = Proc(cmd, cwd=data_dir.parent, env=child_env())
    proc.token = token
    if wait:
        try:
            found = proc.wait_for(
                {"url": r"InstantML local API on (http://\S+)", "token": r"export INSTANTML_API_KEY=(\S+)"}
            )
        except BaseException:
            proc.stop()
            raise
        proc.url, proc.token = found["url"], found["token"]
    return proc


def start_floor_server(workdir: Path) -> Proc:
    token = secrets.token_urlsafe(24)
    cmd = [sys.executable, "-m", "benchmarks.local_stack", "--floor-server", str(workdir / "floor2.db")]
    proc = Proc([*cmd, f"--token={token}"], cwd=workdir, env=child_env())
    try:
        proc.url = proc.wait_for({"url": r"floor server on (http://\S+)"})["url"]
    except BaseException:
        proc.stop()
        raise
    proc.token = token
    return proc


def mlflow_executable() -> tuple[Path | None, str]:
    """MLflow's command from ``.cache/venv-mlflow`` (made when missing), and its version or why not."""
    mlflow = MLFLOW_VENV / "bin" / "mlflow"
    if not mlflow.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        print(f"  making {MLFLOW_VENV.relative_to(ROOT)} for MLflow (a few minutes, once)", flush=True)
        subprocess.run([base, "-m", "venv", str(MLFLOW_VENV)], check=True)
        pip = [str(MLFLOW_VENV / "bin" / "pip"), "install", "--quiet"]
        for requirement in MLFLOW_REQUIREMENTS:
            if subprocess.run([*pip, requirement]).returncode == 0:
                break
        if not mlflow.exists():
            return None, f"could not install any of {MLFLOW_REQUIREMENTS}"
    version = subprocess.run(
        [str(MLFLOW_VENV / "bin" / "python"), "-c", "import mlflow; print(mlflow.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return mlflow, version


def start_mlflow(mlflow: Path, workdir: Path) -> Proc:
    """MLflow's tracking server on SQLite with its defaults (uvicorn, 4 workers) but without its job
    executor (about 8 huey consumer processes polling, unrelated to logging metrics, that would take CPU
    from every variant on 2 cores); ready at /health."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}"]
    cmd += ["--artifacts-destination", str(workdir / "artifacts"), "--host", "127.0.0.1", "--port", str(port)]
    proc = Proc(
        cmd,
        cwd=workdir,
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_ENABLE_TELEMETRY="false"),
    )
    proc.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"mlflow server exited ({proc.popen.returncode}): {proc.stderr_tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if Client(proc.url, "").request("GET", "/health")[0] == 200:
                return proc
        if time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"mlflow server not ready in 180 s: {proc.stderr_tail()}")
        time.sleep(0.2)


# HTTP: keep-alive clients, the same for every server ---------------------------------------------


class Client:
    def __init__(self, url: str, token: str, timeout: float = 600.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname or "127.0.0.1", parts.port or 80, timeout
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        self.retries = 0  # 429 and 503 answered (retried after Retry-After)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        for attempt in range(2):  # once more on a fresh connection if the server closed the kept one
            try:
                self.conn.request(method, path, body, self.headers)
                response = self.conn.getresponse()
                return response.status, response.read()
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def ok(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """The body of a 200/201, retrying 429 and 503 as the client does; anything else raises."""
        for _ in range(100):
            status, data = self.request(method, path, body)
            if status in (200, 201):
                return data
            if status not in (429, 503):
                raise RuntimeError(f"{method} {path.split('?')[0]}: {status} {data[:300]!r}")
            self.retries += 1
            time.sleep(0.5)
        raise RuntimeError(f"{method} {path}: still {status} after 100 tries")

    def close(self) -> None:
        self.conn.close()


@dataclass
class Sent:
    seconds: float
    requests: int
    stored: int  # from the batch route's answers (0 for MLflow's empty ones)
    retries: int


def post_all(url: str, token: str, requests: Iterable[tuple[str, Callable[[], bytes]]], clients: int) -> Sent:
    """Send every request from ``clients`` keep-alive threads; a request is taken by the first free one."""
    lock = threading.Lock()
    counts = {"requests": 0, "stored": 0, "retries": 0}

    def post(client: Client, item: tuple[str, Callable[[], bytes]]) -> None:
        path, body = item
        data = client.ok("POST", path, body())
        stored = json.loads(data).get("stored", 0) if data.startswith(b"{") else 0
        with lock:
            counts["requests"] += 1
            counts["stored"] += stored

    def count_retries(client: Client) -> None:
        with lock:
            counts["retries"] += client.retries

    elapsed = in_threads(lambda: Client(url, token), requests, post, clients, count_retries)
    return Sent(elapsed, counts["requests"], counts["stored"], counts["retries"])


def prebuilt(path: str, bodies: Iterable[bytes]) -> list[tuple[str, Callable[[], bytes]]]:
    return [(path, lambda body=body: body) for body in bodies]


def load_runs(ctx: Context, stack: Proc, runs: Sequence[str], steps: int, label: str) -> Sent:
    """Store whole runs through the batch route (the honest way in); prints the rate."""
    requests = (item for run in runs for item in run_batches(run, steps))
    sent = post_all(stack.url, stack.token, requests, ctx.clients)
    report_load(f"{label}: ", len(runs) * steps * RANKS, sent)
    return sent


def report_load(label: str, expected: int, sent: Sent) -> None:
    print(
        f"  (loaded {label}{expected:,} events through the batch route in {sent.seconds:.1f} s, "
        f"{expected / sent.seconds:,.0f} events/s, {sent.retries} retries)",
        flush=True,
    )
    if sent.stored != expected:
        print(f"  ! the stack answered {sent.stored:,} stored of {expected:,}")


def time_summary(client: Client, run: str) -> float:
    started = time.perf_counter()
    json.loads(client.ok("GET", summary_path(run)))
    return time.perf_counter() - started


# The figures ---------------------------------------------------------------------------------------


def fig_ingest(ctx: Context) -> None:
    n, rounds = ctx.sizes.ingest_events, ctx.rounds
    print(
        f"\n1. batch ingest through HTTP: {n:,} events (64 ranks x 4 keys) in 1,000-event batches, "
        f"{ctx.clients} clients, a fresh store per variant and round, median of {rounds}",
        flush=True,
    )
    mlflow, mlflow_version = mlflow_executable() if ctx.mlflow else (None, "skipped (--no-mlflow)")
    rates: dict[str, list[float]] = defaultdict(list)
    for r in range(rounds):
        run = f"ingest-{r}"
        events = list(islice(run_events(run, range(n // RANKS + 1), seed=r), n))
        batches = list(chunks(events, BATCH))
        bodies = [batch_body(chunk) for chunk in batches]
        rows = [[floor_row(run, e) for e in chunk] for chunk in batches]
        # One step of another run per client before the clock: first requests load code, open stores.
        warm = [list(run_events(f"warm-{i}", range(1), seed=r)) for i in range(ctx.clients)]
        workdir = Path(tempfile.mkdtemp(prefix=f"ingest-{r}-", dir=ctx.workdir))

        db = floor_db(workdir / "floor1.db")
        started = time.perf_counter()
        stored = sum(sum(floor_insert(db, chunk)) for chunk in rows)
        rates["floor 1"].append(n / (time.perf_counter() - started))
        db.close()
        assert stored == n, stored

        for name, start in (
            ("floor 2", lambda w=workdir: start_floor_server(w)),
            ("ours", lambda w=workdir: start_stack(ctx, w / "stack")),
        ):
            server = start()
            try:
                warm_up(ctx, server, [(batch_path(f"warm-{i}"), batch_body(e)) for i, e in enumerate(warm)])
                sent = post_all(server.url, server.token, prebuilt(batch_path(run), bodies), ctx.clients)
            finally:
                server.stop()
            rates[name].append(n / sent.seconds)
            if sent.stored != n or sent.retries:
                print(f"  ! {name}: {sent.stored:,} stored of {n:,}, {sent.retries} retries (429/503)")

        if mlflow is not None:
            for name, rank_in_key in (("mlflow ranks", True), ("mlflow plain", False)):
                rate = ingest_mlflow(ctx, mlflow, workdir / name.replace(" ", "-"), events, warm, rank_in_key)
                rates[name].append(rate)
        done = ", ".join(f"{name} {values[-1]:,.0f}" for name, values in rates.items())
        print(f"  round {r + 1}: {done} events/s", flush=True)

    medians = {name: statistics.median(values) for name, values in rates.items()}
    ours = medians["ours"]
    ctx.ours_ingest = ours
    labels = {
        "floor 1": "floor 1: sqlite3 WAL, RETURNING per row",
        "floor 2": "floor 2: stdlib HTTP + json + floor 1",
        "ours": "ours: instantml local",
        "mlflow ranks": f"MLflow {mlflow_version}, key/rankNN keys",
        "mlflow plain": f"MLflow {mlflow_version}, 4 keys, rank dropped",
    }
    fastest_mlflow = max((medians[m] for m in ("mlflow ranks", "mlflow plain") if m in medians), default=None)
    print(f"  {'variant':<42} {'events/s':>10} {'ours / it':>10}  {'rounds':<28} reference")
    for name, label in labels.items():
        if name not in medians:
            print(f"  {label:<42} {'-':>10}  {mlflow_version}")
            continue
        ratio = "" if name == "ours" else f"{ours / medians[name]:.2f}x"
        each = ", ".join(f"{v:,.0f}" for v in rates[name])
        if name == "ours":
            reference = f"goal >= {GOAL_INGEST:,} ({ours / GOAL_INGEST:.2f}x of it)"
        elif medians[name] == fastest_mlflow:
            reference = f"goal ours >= {GOAL_VS_MLFLOW:g}x the faster MLflow; {QUIET['mlflow']} quiet"
        else:
            reference = f"{QUIET[name]} on a quiet machine" if name in QUIET else ""
        print(f"  {label:<42} {medians[name]:>10,.0f} {ratio:>10}  {each:<28} {reference}")
    if fastest_mlflow:
        print(
            f"  (MLflow: {MLFLOW_METRICS_PER_REQUEST} metric values per log-batch = 250 rank events; "
            "4 uvicorn workers, its job executor off. A per-rank view needs the rank in the key, "
            "256 keys a run; without it the 64 ranks' values share 4 keys, told apart by their timestamps)"
        )


def ingest_mlflow(
    ctx: Context,
    mlflow: Path,
    workdir: Path,
    events: list[dict[str, Any]],
    warm: list[list[dict[str, Any]]],
    rank_in_key: bool,
) -> float:
    """Events/s of MLflow's log-batch on a fresh server and database, after one warm request per client."""
    server = start_mlflow(mlflow, workdir)
    try:
        log_batch = "/api/2.0/mlflow/runs/log-batch"
        warm_up(ctx, server, [(log_batch, mlflow_body(mlflow_run(server), e, rank_in_key)) for e in warm])
        run_id = mlflow_run(server)
        per_request = MLFLOW_METRICS_PER_REQUEST // len(KEYS)
        bodies = [mlflow_body(run_id, chunk, rank_in_key) for chunk in chunks(events, per_request)]
        sent = post_all(server.url, "", prebuilt(log_batch, bodies), ctx.clients)
        if sent.retries:
            print(f"  ! mlflow: {sent.retries} retries (429/503)")
        return len(events) / sent.seconds
    finally:
        server.stop()


def warm_up(ctx: Context, server: Proc, requests: list[tuple[str, bytes]]) -> None:
    post_all(
        server.url, server.token, [(path, lambda body=body: body) for path, body in requests], ctx.clients
    )


def mlflow_run(server: Proc) -> str:
    client = Client(server.url, "")
    body = json.dumps({"experiment_id": "0", "start_time": int(time.time() * 1000)}).encode()
    run_id: str = json.loads(client.ok("POST", "/api/2.0/mlflow/runs/create", body))["run"]["info"]["run_id"]
    client.close()
    return run_id


def mlflow_body(run_id: str, events: list[dict[str, Any]], rank_in_key: bool = True) -> bytes:
    metrics = [
        {
            "key": f"{key}/rank{e['rank']:02d}" if rank_in_key else key,
            "value": value,
            "timestamp": int(e["time"] * 1000),
            "step": e["step"],
        }
        for e in events
        for key, value in e["metrics"].items()
    ]
    return json.dumps({"run_id": run_id, "metrics": metrics}).encode()


def fig_sync(ctx: Context) -> None:
    n = ctx.sizes.sync_events
    print(
        f"\n2. instantml sync of a {n:,}-event spool (64 ranks x 4 keys, offline mode), "
        f"median of {ctx.rounds}"
    )
    import instantml as im

    times, codes = [], []
    stack = start_stack(ctx, ctx.workdir / "sync-stack")
    try:
        load_runs(ctx, stack, ["warm"], 1, "one step first, so that no round pays the stack's first request")
        for r in range(ctx.rounds):
            spool = Path(tempfile.mkdtemp(prefix=f"spool-{r}-", dir=ctx.workdir))
            run = im.init(project=PROJECT, run_id=f"sync-{r}", upload_mode="offline", spool_dir=spool)
            for e in islice(run_events(f"sync-{r}", range(n // RANKS + 1)), n):
                run.log_rank_metrics(
                    e["metrics"], step=e["step"], rank=e["rank"], world_size=RANKS, weight=e["weight"]
                )
            run.finish()
            cmd = [sys.executable, "-m", "instantml.cli", "sync", str(spool), "--quiet"]
            cmd += [f"--api-url={stack.url}", f"--api-key={stack.token}"]
            started = time.perf_counter()
            result = subprocess.run(cmd, cwd=ctx.workdir, env=child_env(), capture_output=True, text=True)
            times.append(time.perf_counter() - started)
            codes.append(result.returncode)
            if result.returncode != 0:
                print(f"  ! sync exited {result.returncode}: {result.stderr.strip()[-500:]}")
    finally:
        stack.stop()
    rate = n / statistics.median(times)
    each = ", ".join(f"{n / t:,.0f}" for t in times)
    reference = (
        f"; ours through HTTP (figure 1): {ctx.ours_ingest:,.0f}, sync / that {rate / ctx.ours_ingest:.2f}x"
        if ctx.ours_ingest
        else ""
    )
    print(
        f"  sync: {rate:,.0f} events/s (rounds {each}; exit codes {codes}); goal >= {GOAL_SYNC:,} "
        f"({rate / GOAL_SYNC:.2f}x of it){reference}"
    )


def fig_summary(ctx: Context) -> None:
    steps, others = ctx.sizes.summary_steps, ctx.sizes.other_runs
    asks = max(5, ctx.rounds)
    print(
        f"\n3. summary (GET .../distributed?keys={','.join(SUMMARY_KEYS)}) of a 64 x {steps:,} run, alone "
        f"and with {others} other runs of that size stored; median of {asks} GETs, one client"
    )
    other_runs = [f"other-{i:02d}" for i in range(others)]
    workdir = Path(tempfile.mkdtemp(prefix="summary-", dir=ctx.workdir))

    # The floor: the same rows in bare sqlite3, read and decoded alone, then with the other runs.
    floor: dict[str, float] = {}
    for label, runs in (("alone", ["summary"]), ("crowded", ["summary", *other_runs])):
        db = floor_db(workdir / f"floor-{label}.db", indexes=())
        floor_store_runs(db, runs, steps)
        floor[label] = statistics.median(timed(lambda db=db: floor_summary(db, "summary", steps), asks))
        db.close()

    ours: dict[str, list[float]] = {}
    stack = start_stack(ctx, workdir / "stack")
    try:
        load_runs(ctx, stack, ["summary"], steps, "the summarized run")
        client = Client(stack.url, stack.token)
        ours["alone"] = [time_summary(client, "summary") for _ in range(asks)]
        load_runs(ctx, stack, other_runs, steps, f"{others} other runs")
        ours["crowded"] = [time_summary(client, "summary") for _ in range(asks)]
        client.close()
    finally:
        stack.stop()
    alone, crowded = statistics.median(ours["alone"]), statistics.median(ours["crowded"])
    print(f"  {'':<30} {'ours s':>8} {'first s':>8} {'floor s':>8} {'ours/floor':>10}  goal")
    for label, median, goal in (
        ("alone", alone, f"<= {GOAL_SUMMARY_S} s"),
        (f"with {others} other runs", crowded, f"within {GOAL_CROWDED}x of alone"),
    ):
        key = "alone" if label == "alone" else "crowded"
        print(
            f"  {label:<30} {median:>8.3f} {ours[key][0]:>8.3f} {floor[key]:>8.3f} "
            f"{median / floor[key]:>9.1f}x  {goal}"
        )
    print(
        f"  with/alone: ours {crowded / alone:.2f}x (goal <= {GOAL_CROWDED}x), "
        f"floor {floor['crowded'] / floor['alone']:.2f}x"
    )


def timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def fig_p99(ctx: Context) -> None:
    n, steps = ctx.sizes.p99_batches, ctx.sizes.summary_steps
    print(
        f"\n4. ingest latency of single 1,000-event batches ({n} one at a time per phase), alone and while "
        f"a thread asks for summaries of a 64 x {steps:,} run in a loop; median of {ctx.rounds} rounds"
    )
    workdir = Path(tempfile.mkdtemp(prefix="p99-", dir=ctx.workdir))
    phases: dict[str, list[list[float]]] = defaultdict(list)
    summaries: list[float] = []
    stack = start_stack(ctx, workdir / "stack")
    try:
        load_runs(ctx, stack, ["summary"], steps, "the summarized run")
        client = Client(stack.url, stack.token)
        for r in range(ctx.rounds):
            for phase in ("alone", "with summaries"):
                run = f"p99-{r}-{phase.replace(' ', '-')}"
                path = batch_path(run)
                bodies = [
                    batch_body(c) for c in chunks(run_events(run, range(n * BATCH // RANKS + 1)), BATCH)
                ][:n]
                stop = threading.Event()
                loop = threading.Thread(target=summary_loop, args=(stack, stop, summaries))
                if phase != "alone":
                    loop.start()
                    time.sleep(0.2)  # a summary under way before the first batch
                latencies = []
                for body in bodies:
                    started = time.perf_counter()
                    client.ok("POST", path, body)
                    latencies.append(time.perf_counter() - started)
                stop.set()
                if loop.is_alive():
                    loop.join()
                phases[phase].append(latencies)
        client.close()
    finally:
        stack.stop()
    p50 = {phase: statistics.median(statistics.median(x) for x in rounds) for phase, rounds in phases.items()}
    p99 = {phase: statistics.median(percentile(x, 0.99) for x in rounds) for phase, rounds in phases.items()}
    for phase in ("alone", "with summaries"):
        print(f"  {phase:<16} p50 {p50[phase] * 1e3:8.1f} ms   p99 {p99[phase] * 1e3:8.1f} ms")
    ratio = p99["with summaries"] / p99["alone"]
    done = (
        f"{len(summaries)} summaries, median {statistics.median(summaries):.2f} s"
        if summaries
        else "none done"
    )
    print(f"  p99 with / alone: {ratio:.2f}x (goal within {GOAL_P99}x); summaries meanwhile: {done}")


def summary_loop(stack: Proc, stop: threading.Event, times: list[float]) -> None:
    client = Client(stack.url, stack.token)
    try:
        while not stop.is_set():
            times.append(time_summary(client, "summary"))
    finally:
        client.close()


def load_big_dir(ctx: Context, stack: Proc) -> None:
    """``sizes.big_events`` events as runs of 64 x 1,000 steps (the last one shorter), plus a 64-event
    probe run for the restart figure; through the batch route."""
    n = ctx.sizes.big_events
    full_runs, rest = divmod(n, RANKS * 1000)
    load_runs(ctx, stack, ["probe"], 1, "the probe run")
    requests: list[Iterator[tuple[str, Callable[[], bytes]]]] = [
        run_batches(f"big-{i:02d}", 1000) for i in range(full_runs)
    ]
    if rest:
        requests.append(
            (batch_path(f"big-{full_runs:02d}"), lambda c=c: batch_body(c))
            for c in chunks(islice(run_events(f"big-{full_runs:02d}", range(rest // RANKS + 1)), rest), BATCH)
        )
    sent = post_all(stack.url, stack.token, (item for run in requests for item in run), ctx.clients)
    report_load("", n, sent)


def fig_rss(ctx: Context) -> None:
    n = ctx.sizes.big_events
    print(f"\n5. the stack's memory (VmRSS summed over its process tree) after {n:,} stored events")
    ctx.big_dir = ctx.workdir / "big" / "stack"
    stack = start_stack(ctx, ctx.big_dir)
    try:
        time.sleep(1.0)
        idle = stack.rss_mib()
        load_big_dir(ctx, stack)
        loaded = stack.rss_mib()
        client = Client(stack.url, stack.token)
        time_summary(client, "big-00")
        client.close()
        after_summary = stack.rss_mib()
    finally:
        stack.stop()
    print(f"  {'':<36} {'RSS MiB':>8} {'peak MiB':>9} {'processes':>10}")
    for label, (rss, peak, count) in (
        ("idle, right after start", idle),
        (f"after {n:,} events", loaded),
        (f"after one summary of a {min(n, RANKS * 1000):,}-event run", after_summary),
    ):
        print(f"  {label:<36} {rss:>8.0f} {peak:>9.0f} {count:>10}")
    print(
        f"  after {n:,} events / idle: {loaded[0] / idle[0]:.1f}x; goal <= {GOAL_RSS_MIB} MiB "
        f"({loaded[0] / GOAL_RSS_MIB:.2f}x of it)"
    )


def fig_restart(ctx: Context) -> None:
    n = ctx.sizes.big_events
    print(f"\n6. restart: process start to the first authenticated GET answered 200, median of {ctx.rounds}")
    if not ctx.data_dir_flag:
        print("  skipped: this checkout's `instantml local` has no --data-dir, so nothing survives a restart")
        return
    if ctx.big_dir is None:  # figure 5 did not run: load the directory here
        ctx.big_dir = ctx.workdir / "big" / "stack"
        stack = start_stack(ctx, ctx.big_dir)
        try:
            load_big_dir(ctx, stack)
        finally:
            stack.stop()
    empty = ctx.workdir / "probe-only" / "stack"
    stack = start_stack(ctx, empty)
    try:
        load_runs(ctx, stack, ["probe"], 1, "the probe run")
    finally:
        stack.stop()
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(ctx.rounds):
        for label, directory in (("probe only", empty), (f"{n:,} events", ctx.big_dir)):
            times[label].append(time_restart(ctx, directory))
    ref, big = (statistics.median(v) for v in times.values())
    for label, values in times.items():
        print(
            f"  {label:<20} {statistics.median(values):7.2f} s  "
            f"(rounds {', '.join(f'{v:.2f}' for v in values)})"
        )
    print(
        f"  {n:,} events / probe only: {big / ref:.2f}x; goal <= {GOAL_RESTART_S} s "
        f"({big / GOAL_RESTART_S:.2f}x of it)"
    )


def time_restart(ctx: Context, directory: Path) -> float:
    """Start the stack on ``directory`` (a known port, the directory's token) and poll the probe run's
    summary until it answers 200."""
    port, token = free_port(), ctx.tokens[directory]
    started = time.perf_counter()
    stack = start_stack(ctx, directory, port=port, token=token, wait=False)
    try:
        client = Client(f"http://127.0.0.1:{port}", token, timeout=30)
        while True:
            if stack.popen.poll() is not None:
                raise RuntimeError(f"the stack exited ({stack.popen.returncode}): {stack.stderr_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if client.request("GET", summary_path("probe"))[0] == 200:
                    elapsed = time.perf_counter() - started
                    client.close()
                    return elapsed
            if time.perf_counter() - started > 120:
                raise RuntimeError("no answer in 120 s")
            time.sleep(0.005)
    finally:
        stack.stop()


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--figures", default=",".join(FIGURES), help=f"comma-separated, of {','.join(FIGURES)}"
    )
    parser.add_argument("--rounds", type=int, help="default 3 (1 with --quick)")
    parser.add_argument(
        "--clients", type=int, default=4, help="concurrent keep-alive clients per HTTP variant"
    )
    parser.add_argument("--ingest-events", type=int, help="figure 1's events per variant and round")
    parser.add_argument("--no-mlflow", action="store_true", help="skip MLflow in figure 1")
    parser.add_argument("--floor-server", help=argparse.SUPPRESS)  # floor 2's own process
    parser.add_argument("--token", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        serve_floor(args.floor_server, args.token)
        return 0
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = set(figures) - set(FIGURES)
    if unknown:
        parser.error(f"unknown figures {sorted(unknown)}; choose from {','.join(FIGURES)}")
    # `kill PID` of this benchmark unwinds like Ctrl-C: every server it started is stopped on the way out.
    signal.signal(signal.SIGTERM, interrupt)
    sizes = QUICK if args.quick else FULL
    if args.ingest_events:
        sizes = dataclasses.replace(sizes, ingest_events=args.ingest_events)
    with tempfile.TemporaryDirectory(prefix="instantml-bench-") as workdir:
        ctx = Context(
            sizes=sizes,
            rounds=args.rounds or sizes.rounds,
            clients=args.clients,
            workdir=Path(workdir),
            mlflow=not args.no_mlflow,
            data_dir_flag=stack_takes_data_dir(),
        )
        print(
            f"# local stack benchmark{' (--quick: small sizes, a smoke run)' if args.quick else ''}: "
            f"Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.1f} at start; checkout {ROOT}"
        )
        if not ctx.data_dir_flag:
            print(
                "# this checkout's `instantml local` has no --data-dir: "
                "its stack keeps nothing across restarts"
            )
        for figure in figures:
            {
                "ingest": fig_ingest,
                "sync": fig_sync,
                "summary": fig_summary,
                "p99": fig_p99,
                "rss": fig_rss,
                "restart": fig_restart,
            }[figure](ctx)
        print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
