"""One long 512-rank run through `instantml local`, and what reading it costs (issue 27's figures).

    .venv/bin/python -m benchmarks.big_run [--ranks 512] [--steps 20000] [--clients 4] [--small]

The run: ``--ranks`` ranks x ``--steps`` steps x 4 keys (10,240,000 events by default) posted through the
batch route (1,000 events a request, from ``--clients`` keep-alive threads; each tenth's bodies are
made before it is sent, untimed), into a fresh ``instantml local`` on a temporary directory, started and
stopped here by its pid. Then, side by side with the floor (bare ``sqlite3`` + numpy on the same rows:
the rows read from an index on (run, step), decoded with ``frombuffer``, per-step mean and std, the
columns averaged):

1. ingest: events/s over each tenth of the load (goal: >= 30,000 in every tenth, no decay as the table
   grows), the rollup worker catching up after it, and disk per event;
2. the whole-run summary (200 columns, every key, ``heatmap=auto``): first GET and warm (goal <= 1.5 s
   and <= 0.5 s), its resolution, and its size uncompressed and gzipped (goal <= 6 MB uncompressed);
3. 1% windows at full step resolution (5 windows, each GET twice; goal: warm <= 0.3 s);
4. a 64 x 1,000 run's summary, first GET after a restart of the stack (goal <= 0.3 s), once the stack's
   worker processes have started (another run's window asked first);
5. a live tab's refresh of a 64 x 500 run after one new step, with ``since`` (goal <= 5% of a full
   summary's bytes);
6. the stack's RSS (summed over its process tree), sampled every second through all of it (goal <= 1 GiB).

``--small`` (64 ranks x 2,000 steps) is a smoke run of the same code; its figures say little.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.local_stack import (  # noqa: E402
    QUICK,
    Client,
    Context,
    Proc,
    post_all,
    proc_stat,
    process_tree,
    start_stack,
)
from infra.local.stack import WATCH_NICE  # noqa: E402
from infra.local.triggers import ROLLUP_NICE  # noqa: E402
from instantml import limits, routes  # noqa: E402
from shared.summary.rolling import SETTLE_STEPS  # noqa: E402

PROJECT = "bench"
KEYS = ("train/loss", "optimizer/grad_norm", "perf/step_time_s", "memory/allocated_gib")
BATCH = limits.MAX_BATCH_EVENTS
GOALS = {"ingest": 30_000, "first": 1.5, "warm": 0.5, "window": 0.3, "restart": 0.3, "refresh": 0.05}
GOAL_BODY_MB = 6.0
GOAL_RSS_MIB = 1024


def event_json(step: int, rank: int, ranks: int, row: list[float]) -> str:
    values = row
    return (
        f'{{"event_id":"{step}-{rank}","step":{step},"rank":{rank},"world_size":{ranks},'
        f'"local_rank":{rank % 8},"weight":1024.0,"time":{1_764_672_000 + step * 0.2 + rank * 1e-4:.4f},'
        f'"metrics":{{"{KEYS[0]}":{values[0]!r},"{KEYS[1]}":{values[1]!r},"{KEYS[2]}":{values[2]!r},'
        f'"{KEYS[3]}":{values[3]!r}}}}}'
    )


def step_values(step: int, ranks: int) -> np.ndarray:
    """ranks x 4 values of one step, deterministic: loss decays with per-rank noise, grad_norm is
    all-reduced, step time has one slow rank (7), memory grows with the rank."""
    rng = np.random.default_rng(step)
    loss = 2.4 / (1 + step / 600) + 0.2 + rng.normal(0, 0.01, ranks)
    grad = np.full(ranks, 3.0 + 0.3 * rng.random())
    step_time = 0.25 + rng.normal(0, 0.005, ranks)
    step_time[7 % ranks] *= 1.2
    memory = 21.5 + np.arange(ranks) / 64
    return np.stack([loss, grad, step_time, memory], axis=1)


def batches(run: str, ranks: int, steps: range) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """The run as batch requests of ``BATCH`` events in step order, each body made when it is sent."""
    path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run)
    pairs = ((s, r) for s in steps for r in range(ranks))
    while True:
        chunk = [p for _, p in zip(range(BATCH), pairs, strict=False)]
        if not chunk:
            return

        def body(chunk: list[tuple[int, int]] = chunk) -> bytes:
            values = {s: step_values(s, ranks).tolist() for s in {s for s, _ in chunk}}
            events = ",".join(event_json(s, r, ranks, values[s][r]) for s, r in chunk)
            return f'{{"events":[{events}]}}'.encode()

        yield path, body


def prebuilt_all(
    requests: Iterator[tuple[str, Callable[[], bytes]]],
) -> list[tuple[str, Callable[[], bytes]]]:
    """The requests with their bodies made now (about 330 MB a tenth of the default run)."""
    return [(path, _ready(body())) for path, body in requests]


def _ready(body: bytes) -> Callable[[], bytes]:
    return lambda: body


def summary_path(run: str, **params: Any) -> str:
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    return routes.DISTRIBUTED.format(project=PROJECT, run_id=run) + ("?" + query if query else "")


class RssSampler:
    """The stack's RSS every second, through the whole benchmark (restarts included: ``watch``)."""

    def __init__(self) -> None:
        self.proc: Proc | None = None
        self.peak = 0.0
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            if self.proc is not None and self.proc.popen.poll() is None:
                self.peak = max(self.peak, self.proc.rss_mib()[0])


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds used so far by the stack's processes, by role: its own process (the HTTP front and
    the change feed's reader), the rollup worker and the watch (told by their nice values), and the
    functions' workers (ingest among them: the only ones busy during a load)."""
    tick = os.sysconf("SC_CLK_TCK")
    roles = {"front": 0.0, "functions": 0.0, "rollup": 0.0, "watch": 0.0}
    for pid in process_tree(root):
        fields = proc_stat(pid)
        if fields is None:
            continue
        nice = int(fields[16])
        role = "front" if pid == root else {ROLLUP_NICE: "rollup", WATCH_NICE: "watch"}.get(nice, "functions")
        roles[role] += (int(fields[11]) + int(fields[12])) / tick
    return roles


@dataclass
class Timed:
    seconds: float
    body: bytes
    document: dict[str, Any]


def get(client: Client, path: str) -> Timed:
    started = time.perf_counter()
    body = client.ok("GET", path)
    document = json.loads(body)
    return Timed(time.perf_counter() - started, body, document)


def wait_rolled(client: Client, run: str, last_step: int, ranks: int, timeout: float = 3600) -> float:
    """Wait until the rollup worker has rolled the run up to ``SETTLE_STEPS`` behind its last step."""
    started = time.perf_counter()
    window = summary_path(run, keys=KEYS[0], step_min=max(0, last_step - 2 * SETTLE_STEPS), heatmap="none")
    while time.perf_counter() - started < timeout:
        if get(client, window).document["resolution"]["events_read"] <= ranks * SETTLE_STEPS:
            return time.perf_counter() - started
        time.sleep(0.5)
    raise RuntimeError(f"the rollups of {run} did not catch up in {timeout:.0f} s")


# The floor: bare sqlite3 + numpy on the same rows -------------------------------------------------


def floor_db(path: Path, run: str, ranks: int, steps: int) -> sqlite3.Connection:
    """The run's rows in a bare table (the stack's row layout: keys as one string, values packed),
    loaded untimed, with an index on (run, step)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE events (run TEXT, step INTEGER, rank INTEGER, keys TEXT, v BLOB)")
    joined = "\n".join(KEYS)
    for low in range(0, steps, 1000):
        rows = []
        for s in range(low, min(steps, low + 1000)):
            values = step_values(s, ranks)
            for r in range(ranks):
                head = np.array([1024.0, 1_764_672_000 + s * 0.2 + r * 1e-4])
                rows.append((run, s, r, joined, np.concatenate([head, values[r]]).astype("<f8").tobytes()))
        db.execute("BEGIN")
        db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", rows)
        db.execute("COMMIT")
    db.execute("CREATE INDEX by_step ON events (run, step)")
    return db


def floor_summary(db: sqlite3.Connection, run: str, ranks: int, low: int, high: int, columns: int) -> float:
    """Read the window's rows (in chunks of 1,000 steps: bounded memory), per-step mean and std of each
    key over the ranks, then ``columns`` column means; the seconds it took."""
    started = time.perf_counter()
    means = []
    for a in range(low, high + 1, 1000):
        b = min(high, a + 999)
        rows = db.execute(
            "SELECT step, rank, v FROM events WHERE run = ? AND step BETWEEN ? AND ?", (run, a, b)
        ).fetchall()
        packed = np.frombuffer(b"".join(r[2] for r in rows), "<f8").reshape(len(rows), 2 + len(KEYS))
        step = np.fromiter((r[0] for r in rows), np.int64, len(rows)) - a
        rank = np.fromiter((r[1] for r in rows), np.int64, len(rows))
        cube = np.full((len(KEYS), ranks, b - a + 1), np.nan)
        cube[:, rank, step] = packed[:, 2:].T
        means.append(np.stack([cube.mean(axis=1), cube.std(axis=1)]))
    per_step = np.concatenate(means, axis=-1)
    edges = np.linspace(0, per_step.shape[-1], columns + 1).astype(int)
    np.add.reduceat(per_step, edges[:-1], axis=-1)
    return time.perf_counter() - started


def profile_whole(database: Path, run: str) -> None:
    """Where a whole-run summary's time goes, in this process on the stack's own database (WAL: a
    reader beside the running stack): the reads of the levels, the units made of them (numpy), the
    summary's statistics and findings, and the JSON encoding of the answer."""
    from shared.store.sqlite import SqliteStore
    from shared.summary import reads as logic
    from shared.summary import wire
    from shared.summary.query import parse_query

    store = SqliteStore(database)
    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    query = parse_query({})
    originals = {name: getattr(logic, name) for name in ("_cover", "_with_sums", "_units", "summarize_units")}
    labels = {
        "_cover": "read the levels' headers",
        "_with_sums": "read the blocks' sums",
        "_units": "units from the blocks (numpy)",
        "summarize_units": "statistics, findings, document",
    }
    try:
        for name, fn in originals.items():
            setattr(logic, name, timed(labels[name], fn))
        for _ in range(2):  # the second is the one printed: warm
            spent.clear()
            started = time.perf_counter()
            document = logic.distributed_summary(store, PROJECT, run, query, arrays=True)
            assert document is not None
            summarized = time.perf_counter()
            answer = wire.answer(document, query)
            wired = time.perf_counter()
            orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)  # as the summarize function does
            ended = time.perf_counter()
    finally:
        for name, fn in originals.items():
            setattr(logic, name, fn)
        store.db.close()
    spent["the rest: progress, newest events read and decoded"] = summarized - started - sum(spent.values())
    spent["heatmap encoding, version (shared.summary.wire)"] = wired - summarized
    spent["JSON encoding"] = ended - wired
    total = ended - started
    print("  where a warm whole-run summary's time goes (in this process, on the stack's database):")
    for name, seconds in spent.items():
        print(f"    {name:<52} {seconds * 1e3:>7.0f} ms")
    print(f"    {'total':<52} {total * 1e3:>7.0f} ms")


# The figures --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="64 ranks x 2,000 steps: a smoke run")
    args = parser.parse_args()
    ranks, steps = (64, 2_000) if args.small else (args.ranks, args.steps)
    workdir = Path(tempfile.mkdtemp(prefix="instantml-big-run-"))
    ctx = Context(QUICK, 1, args.clients, workdir, mlflow=False, data_dir_flag=True)
    data_dir = workdir / "stack"
    rss = RssSampler()
    stack = start_stack(ctx, data_dir)
    rss.proc = stack
    print(f"instantml local on {data_dir}, pid {stack.pid}; {os.cpu_count()} cores", flush=True)
    try:
        client = Client(stack.url, stack.token)
        big = "big"
        n = ranks * steps

        # 1. Ingest, tenth by tenth.
        print(
            f"\n1. ingest of {n:,} events ({ranks} ranks x {steps:,} steps x {len(KEYS)} keys), "
            f"{BATCH} a request"
        )
        rates = []
        tenth = max(1, steps // 10)
        for i in range(10):
            part = range(i * tenth, steps if i == 9 else (i + 1) * tenth)
            # Built before the tenth is timed: the stack's rate is measured, not this generator's,
            # which would otherwise take a tenth of the 2 cores from it (about 8 us an event).
            made = time.perf_counter()
            bodies = prebuilt_all(batches(big, ranks, part))
            made = time.perf_counter() - made
            cpu_before = cpu_by_role(stack.pid)
            sent = post_all(stack.url, stack.token, bodies, args.clients)
            cpu = {
                role: (t - cpu_before[role]) * 1e6 / (ranks * len(part))
                for role, t in cpu_by_role(stack.pid).items()
            }
            del bodies
            assert sent.stored == ranks * len(part), (sent.stored, ranks * len(part))
            rates.append(ranks * len(part) / sent.seconds)
            print(
                f"  tenth {i + 1:>2}: {rates[-1]:>9,.0f} events/s ({sent.retries} retries; its bodies took "
                f"{made:.1f} s to build, untimed); CPU us an event: "
                + ", ".join(f"{role} {us:.1f}" for role, us in cpu.items()),
                flush=True,
            )
        catch_up = wait_rolled(client, big, steps - 1, ranks)
        db_bytes = sum(f.stat().st_size for f in data_dir.rglob("*") if f.is_file())
        print(
            f"  slowest tenth {min(rates):,.0f} events/s, fastest {max(rates):,.0f} "
            f"(goal >= {GOALS['ingest']:,} in every tenth: "
            f"{'met' if min(rates) >= GOALS['ingest'] else 'NOT met'}); the rollups caught up "
            f"{catch_up:.1f} s after the last request; disk {db_bytes / 2**20:,.0f} MiB, "
            f"{db_bytes / n:.0f} bytes per event (events, index and every level of rollups)"
        )

        print("\n   building the floor's table of the same rows (untimed) ...", flush=True)
        floor = floor_db(workdir / "floor.db", big, ranks, steps)

        # 2. The whole run.
        print(f"\n2. the whole run's summary: {ranks} ranks, 200 columns, {len(KEYS)} keys")
        first = get(client, summary_path(big))
        warm = min((get(client, summary_path(big)) for _ in range(3)), key=lambda t: t.seconds)
        doc = first.document
        gz = len(gzip.compress(first.body, 6))
        floor_whole = floor_summary(floor, big, ranks, 0, steps - 1, 200)
        print(
            f"  first {first.seconds:.2f} s (goal <= {GOALS['first']}), warm {warm.seconds:.2f} s (goal <= "
            f"{GOALS['warm']}); floor (every row read, per-step numpy) {floor_whole:.2f} s: ours/floor warm "
            f"{warm.seconds / floor_whole:.2f}x"
        )
        print(
            f"  {len(doc['steps'])} columns of {doc['bin_size']} steps, resolution {doc['resolution']}, "
            f"heatmap {doc['heatmap_encoding']}; body {len(first.body) / 1e6:.2f} MB uncompressed "
            f"(goal <= {GOAL_BODY_MB}), {gz / 1e6:.2f} MB gzipped"
        )

        profile_whole(data_dir / "instantml.db", big)

        # 3. 1% windows at full resolution.
        width = max(1, steps // 100)
        rng = random.Random(0)
        starts = [rng.randrange(0, steps - width) for _ in range(5)]
        print(f"\n3. 1% windows ({width} steps) at full step resolution, each asked twice")
        worst = 0.0
        for start in starts:
            path = summary_path(big, step_min=start, step_max=start + width - 1)
            cold, again = get(client, path), get(client, path)
            fl = floor_summary(floor, big, ranks, start, start + width - 1, width)
            worst = max(worst, again.seconds)
            res = again.document["resolution"]
            print(
                f"  steps {start:>6}-{start + width - 1:<6}: first {cold.seconds:.3f} s, "
                f"warm {again.seconds:.3f} s; floor {fl:.3f} s; {len(again.document['steps'])} columns of "
                f"{again.document['bin_size']}, level {res['level_steps']}, "
                f"{res['rollup_blocks_read']} blocks + {res['events_read']} events read"
            )
        print(f"  worst warm {worst:.3f} s (goal <= {GOALS['window']})")

        # 5. A live tab's refresh (before the restart: a new step arrives on a live run).
        print("\n5. a live tab's refresh: a 64 x 500 run, one new step, GET with since=<version>")
        post_all(stack.url, stack.token, batches("live", 64, range(500)), args.clients)
        full = get(client, summary_path("live"))
        post_all(stack.url, stack.token, batches("live", 64, range(500, 501)), 1)
        refresh = get(client, summary_path("live", since=full.document["version"]))
        again_full = get(client, summary_path("live"))
        kind = "delta" if "since" in refresh.document else "whole"
        print(
            f"  full summary {len(again_full.body) / 1e3:,.0f} KB "
            f"({len(gzip.compress(again_full.body)) / 1e3:,.0f} KB gzipped); the refresh ({kind}, "
            f"from column {refresh.document.get('from_column')}) "
            f"{len(refresh.body) / 1e3:,.1f} KB ({len(gzip.compress(refresh.body)) / 1e3:,.1f} KB gzipped): "
            f"{len(refresh.body) / len(again_full.body):.1%} of the full (goal <= {GOALS['refresh']:.0%})"
        )

        # 4. First GET after a restart.
        print("\n4. a 64 x 1,000 run's summary, the first GET after a restart")
        post_all(stack.url, stack.token, batches("small", 64, range(1000)), args.clients)
        wait_rolled(client, "small", 999, 64)
        floor_small = floor_db(workdir / "floor-small.db", "small", 64, 1000)
        client.close()
        stack.stop()
        stack = start_stack(ctx, data_dir)
        rss.proc = stack
        client = Client(stack.url, stack.token)
        # The function's worker processes start with the stack (imports, a second or two on 2 cores):
        # another run's small window, asked until both workers have answered, then the run's first GET.
        for _ in range(4):
            get(client, summary_path("live", step_min=0, step_max=4, heatmap="none"))
        after = get(client, summary_path("small"))
        warm_small = get(client, summary_path("small"))
        fl = floor_summary(floor_small, "small", 64, 0, 999, 200)
        print(
            f"  first GET after the restart {after.seconds:.3f} s (goal <= {GOALS['restart']}), then "
            f"{warm_small.seconds:.3f} s; floor {fl:.3f} s; resolution {after.document['resolution']}"
        )

        rss.stop.set()
        print(
            f"\n6. the stack's RSS through all of it: peak {rss.peak:,.0f} MiB (goal <= {GOAL_RSS_MIB} MiB)"
        )
        client.close()
    finally:
        rss.stop.set()
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
