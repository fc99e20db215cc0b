"""Reading a big run back out of ``instantml local`` (issue 37's figures), beside the floor.

    .venv/bin/python -m benchmarks.export [--ranks 512] [--steps 2000] [--small]

The run: ``--ranks`` x ``--steps`` x 4 keys (4,096,000 values by default) posted through the batch route
into a fresh ``instantml local`` on a temporary directory (started and stopped here by its pid), and
read once the stack's rollups have caught up with it (on 2 cores they otherwise share the CPU). Then:

1. ``instantml export`` to csv and to parquet, as a process: values/s and its peak RSS (``wait4``),
   beside the floor: bare ``sqlite3`` over the same database file (the rows by step, unpacked with
   ``struct``, written with ``csv``), in this process;
2. ``api.run(...).rank_metrics(keys=[key]).to_numpy(key)`` for one key, and ``to_pandas()`` of it:
   seconds;
3. the run moved to a second stack on another data directory (``export --format spool`` and
   ``instantml sync``): every value bit-equal (a digest over each stored value's bits, in order), the
   same summary, the seconds each part took.

4. DynamoDB: the same paging (``shared.reading.raw``) over the DynamoDB adapter on moto, every call
   metered by DynamoDB's billing rules (``benchmarks/metering.py``): read units per million values,
   beside the floor (every event item read once, eventually consistent: half a unit per 4 KB of items).

There is no wandb or MLflow read-back here: neither is in this checkout's locks (the client benchmark's
venv has wandb offline only, which keeps no server to read from), so that comparison is not made.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.big_run import KEYS, PROJECT, batches  # noqa: E402
from benchmarks.local_stack import QUICK, Context, post_all, start_stack  # noqa: E402
from shared.store import ROLLUP_FEED  # noqa: E402


def run_timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Seconds, peak RSS (KiB) and stdout of one process."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - started
    out = proc.stdout.read() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed: {out}")
    return took, usage.ru_maxrss, out


def rollups_caught_up(database: Path, timeout_s: float = 600.0) -> None:
    """Wait until the stack's rollup worker has read its change feed to the last stored event, so that
    the reads below are timed on a quiet stack, not beside the background work the posting started."""
    deadline = time.monotonic() + timeout_s
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        while time.monotonic() < deadline:
            (newest,) = conn.execute("SELECT max(rowid) FROM events").fetchone()
            row = conn.execute("SELECT position FROM feed_cursors WHERE name = ?", (ROLLUP_FEED,)).fetchone()
            if row and newest is not None and row[0] >= newest:
                return
            time.sleep(0.5)  # (a benchmark polling a condition, not a test)
    raise SystemExit(f"the rollups did not catch up within {timeout_s:.0f} s")


def floor_csv(database: Path, target: Path) -> int:
    """Bare sqlite3 over the same file: every event of the run by step, unpacked, one csv row a value."""
    count = 0
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn, open(target, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(("step", "rank", "key", "value", "weight", "time", "event_id"))
        (run,) = conn.execute(
            "SELECT id FROM runs WHERE project = ? AND run_id = 'big'", (PROJECT,)
        ).fetchone()
        rows = conn.execute(
            "SELECT step, rank, event_id, keys, v FROM events WHERE run = ? ORDER BY step, rank", (run,)
        )
        for step, rank, event_id, keys, packed in rows:
            numbers = struct.unpack(f"<{len(packed) // 8}d", packed)
            weight, at = repr(numbers[0]), repr(numbers[1])
            for key, value in zip(keys.split("\n"), numbers[2:], strict=True):
                out.writerow((step, rank, key, repr(value), weight, at, event_id))
                count += 1
    return count


def value_digest(api: Any, run_id: str) -> tuple[str, int]:
    digest, n = hashlib.blake2b(digest_size=16), 0
    for row in api.run(PROJECT, run_id).rank_metrics():
        digest.update(
            struct.pack("<qq", row.step, row.rank) + row.key.encode() + struct.pack("<d", row.value)
        )
        n += 1
    return digest.hexdigest(), n


def dynamodb_read_units(ranks: int, steps: int) -> None:
    """Read units per million values of paging a run out of the DynamoDB adapter (moto, metered)."""
    import boto3

    from benchmarks.metering import Meter, Table, item_size, moto_item_reader
    from benchmarks.watch_dynamodb import moto_tables
    from infra import template
    from shared.ingest.bodies import validate_body
    from shared.ingest.parse import to_event
    from shared.reading import raw
    from shared.store.dynamodb import DynamoStore

    with moto_tables() as refs:
        store = DynamoStore(refs["MetricsTable"], runs_table=refs["RunsTable"])
        events = [
            to_event(
                PROJECT,
                "dyn",
                validate_body(
                    {
                        "step": s,
                        "rank": r,
                        "world_size": ranks,
                        "time": 1.7e9 + s,
                        "metrics": {k: s + r / 1000 + i for i, k in enumerate(KEYS)},
                    }
                ),
                f"e-{s}-{r}",
                0.0,
            )
            for s in range(steps)
            for r in range(ranks)
        ]
        for start in range(0, len(events), 500):
            store.put_events(events[start : start + 500])
        scan = boto3.client("dynamodb").get_paginator("scan").paginate(TableName=refs["MetricsTable"])
        items = [item for page in scan for item in page["Items"]]  # (every page: a scan stops at 1 MB)
        floor = sum(item_size(i) for i in items if str(i["pk"]["S"]).startswith(PROJECT)) / 4096 * 0.5
        tables = {
            refs[n]: Table.from_definition(refs[n], template.table_definition(n)) for n in template.tables()
        }
        boto3.setup_default_session()
        meter = Meter(tables, moto_item_reader())
        meter.attach()
        metered = DynamoStore(refs["MetricsTable"], runs_table=refs["RunsTable"])
        cursor, pages, values = None, 0, 0
        while True:
            query = raw.parse_query({"limit": str(raw.MAX_LIMIT), **({"cursor": cursor} if cursor else {})})
            page = raw.read_page(metered.read_event_rows, PROJECT, "dyn", query)
            pages += 1
            values += sum(v is not None for e in page["events"] for v in e["values"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        meter.detach()
    per_million = meter.bill.total_rcu * 1e6 / values
    print(
        f"  {values:,} values ({ranks} ranks x {steps} steps x {len(KEYS)} keys) in {pages} pages: "
        f"{meter.bill.total_rcu:,.1f} read units, {per_million:,.0f} per million values; floor "
        f"{floor * 1e6 / values:,.0f} per million ({meter.bill.total_rcu / floor:.2f}x)"
    )
    items = sum(meter.bill.items_read.values())
    print(
        f"  {sum(meter.bill.calls.values()):,} calls ({dict(meter.bill.calls)}), {items:,} items read for "
        f"{len(events):,} events ({items / len(events):.2f} each)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2_000)
    parser.add_argument("--small", action="store_true", help="64 ranks x 200 steps: a smoke run")
    args = parser.parse_args()
    ranks, steps = (64, 200) if args.small else (args.ranks, args.steps)
    workdir = Path(tempfile.mkdtemp(prefix="instantml-export-"))
    ctx = Context(QUICK, 1, 2, workdir, mlflow=False, data_dir_flag=True)
    stack = start_stack(ctx, workdir / "stack")
    other = start_stack(ctx, workdir / "other")
    import instantml as im

    try:
        values = ranks * steps * len(KEYS)
        print(f"run: {ranks} ranks x {steps:,} steps x {len(KEYS)} keys = {values:,} values")
        started = time.perf_counter()
        post_all(stack.url, stack.token, batches("big", ranks, range(steps)), 2)
        print(f"  posted in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        rollups_caught_up(workdir / "stack" / "instantml.db")
        print(f"  its rollups caught up {time.perf_counter() - started:.1f} s later (timed after that)")
        env = {"INSTANTML_API_URL": stack.url, "INSTANTML_API_KEY": stack.token, "PATH": os.environ["PATH"]}
        cli = [sys.executable, "-m", "instantml.cli"]

        print("\n1. export, as a process (values/s, peak RSS)")
        floor_started = time.perf_counter()
        n = floor_csv(workdir / "stack" / "instantml.db", workdir / "floor.csv")
        floor_s = time.perf_counter() - floor_started
        rate = n / floor_s
        print(f"  floor (sqlite3 + struct + csv, one process): {n:,} values, {floor_s:.1f} s, {rate:,.0f}/s")
        for fmt in ("csv", "parquet"):
            target = workdir / f"big.{fmt}"
            took, rss_kib, _ = run_timed(
                [*cli, "export", "--project", PROJECT, "big", "--format", fmt, "-o", str(target), "--quiet"],
                env,
            )
            print(
                f"  instantml export --format {fmt}: {values / took:,.0f} values/s ({took:.1f} s), "
                f"peak RSS {rss_kib / 1024:.0f} MiB, {target.stat().st_size / 1e6:.0f} MB; "
                f"{floor_s / took:.2f}x the floor's rate"
            )

        print("\n2. to_numpy and to_pandas of one key")
        api = im.Api(stack.url, stack.token)
        started = time.perf_counter()
        matrix = api.run(PROJECT, "big").rank_metrics(keys=[KEYS[0]]).to_numpy(KEYS[0])
        print(f"  {KEYS[0]}: {matrix.shape[0]} x {matrix.shape[1]} in {time.perf_counter() - started:.2f} s")
        started = time.perf_counter()
        frame = api.run(PROJECT, "big").rank_metrics(keys=[KEYS[0]]).to_pandas()
        print(f"  to_pandas of the same key: {len(frame):,} rows in {time.perf_counter() - started:.2f} s")
        del frame

        print("\n3. moved to another stack (export --format spool, then sync)")
        spool = workdir / "moved"
        took, _, _ = run_timed(
            [*cli, "export", "--project", PROJECT, "big", "--format", "spool", "-o", str(spool), "--quiet"],
            env,
        )
        print(f"  export --format spool: {took:.1f} s")
        sync_env = {"INSTANTML_API_KEY": other.token, "PATH": os.environ["PATH"]}
        took, _, _ = run_timed([*cli, "sync", str(spool), "--api-url", other.url, "--quiet"], sync_env)
        print(f"  sync into the other stack: {took:.1f} s")
        here, there = value_digest(api, "big"), value_digest(im.Api(other.url, other.token), "big")
        print(f"  values: {here[1]:,} here, {there[1]:,} there; bit-equal: {here == there}")
        keep = ("version", "generated_at")
        summaries = [
            {k: v for k, v in a.run(PROJECT, "big").summary().items() if k not in keep}
            for a in (api, im.Api(other.url, other.token))
        ]
        print(f"  whole-run summaries identical: {summaries[0] == summaries[1]}")
        print("\n4. DynamoDB (moto, metered): read units per million values")
        dynamodb_read_units(64, 100 if args.small else 400)
    finally:
        stack.stop()
        other.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
