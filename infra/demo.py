"""The demo: the local stack, a simulated 8-rank job through the real client, and its summary.

    python -m infra.demo [--serve] [--port 8787] [--ranks 8] [--steps 200]

Each rank is its own OS process that logs ``train/loss``, ``optimizer/grad_norm`` and
``system/step_time`` with an uneven weight (its batch size). The demo then reads the run's Distributed
summary over HTTP, prints the last steps as a table, and checks that the last step's coverage is full
and that its mean and weighted mean of ``train/loss`` equal what the rank processes logged.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from infra.local import DataDirInUse, LocalStack, view_url
from instantml import replay, routes

PROJECT = "distributed-job"
KEYS = ("train/loss", "optimizer/grad_norm", "system/step_time")


def batch_size(rank: int) -> int:
    return 1024 - 96 * rank  # uneven on purpose: the weighted mean differs from the mean


def rank_process(
    api_url: str, token: str, run_id: str, spool: str, rank: int, world_size: int, steps: int, out: Any
) -> None:
    """One training process: logs every step through the real client, reports its last step's values."""
    import instantml as im

    rng = random.Random(rank)
    last: dict[str, float] = {}
    with im.init(
        project=PROJECT, run_id=run_id, upload_mode="spool", spool_dir=spool, api_url=api_url, api_key=token
    ) as run:
        for step in range(steps):
            last = {
                "train/loss": 2.4 * math.exp(-step / 60) + 0.2 + rng.gauss(0, 0.02),
                "optimizer/grad_norm": 3.0 + rng.gauss(0, 0.3),
                "system/step_time": 0.25 + abs(rng.gauss(0, 0.01)),
            }
            run.log_rank_metrics(last, step=step, rank=rank, world_size=world_size, weight=batch_size(rank))
    out.put((rank, last))


def fetch_summary(base_url: str, token: str, run_id: str, query: str) -> dict[str, Any]:
    path = routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id)
    request = urllib.request.Request(
        f"{base_url}{path}?{query}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        summary: dict[str, Any] = json.load(response)
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def print_table(summary: dict[str, Any], last_columns: int) -> None:
    steps = summary["steps"][-last_columns:]
    coverage = summary["coverage"]
    for key in summary["keys"]:
        reducers = summary["reducers"][key]
        print(f"\n{key}")
        names = ("mean", "w.mean", "min", "max", "std", "p05", "p50", "p95")
        header = f"{'step':>6} {'ranks':>6} " + " ".join(f"{n:>9}" for n in names)
        print(header)
        print("-" * len(header))
        for i in range(len(summary["steps"]) - len(steps), len(summary["steps"])):
            ranks = f"{coverage['reported'][i]}/{coverage['expected'][i]}"
            cells = [
                _fmt(reducers[n][i])
                for n in ("mean", "weighted_mean", "min", "max", "std", "p05", "p50", "p95")
            ]
            print(f"{summary['steps'][i]:>6} {ranks:>6} " + " ".join(f"{c:>9}" for c in cells))
    findings = summary["findings"]
    print("\nFindings:" if findings else "\nFindings: none (a clean run)")
    for finding in findings:
        print(f"  [{finding['severity']}] {finding['message']}")


def check(summary: dict[str, Any], logged: dict[int, dict[str, float]], world_size: int) -> list[str]:
    """What the summary's last step must say about what the ranks logged; returns the problems."""
    problems = []
    last = len(summary["steps"]) - 1
    reported, expected = summary["coverage"]["reported"][last], summary["coverage"]["expected"][last]
    if (reported, expected) != (world_size, world_size):
        problems.append(
            f"last step coverage is {reported} of {expected}, expected {world_size} of {world_size}"
        )
    values = [logged[r]["train/loss"] for r in range(world_size)]
    weights = [batch_size(r) for r in range(world_size)]
    mean = math.fsum(values) / len(values)
    weighted = math.fsum(w * v for w, v in zip(weights, values, strict=True)) / math.fsum(weights)
    reducers = summary["reducers"]["train/loss"]
    for name, want in (("mean", mean), ("weighted_mean", weighted)):
        got = reducers[name][last]
        if got is None or not math.isclose(got, want, rel_tol=1e-12):
            problems.append(f"train/loss {name} at the last step is {got}, the ranks logged {want}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve", action="store_true", help="keep the local stack serving afterwards")
    parser.add_argument("--port", type=int, default=8787, help="0 picks a free port")
    parser.add_argument("--token")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--data-dir", default=".instantml/demo", help="the demo stack's data (kept: runs accumulate)"
    )
    args = parser.parse_args(argv)

    try:
        stack = LocalStack(port=args.port, token=args.token, data_dir=args.data_dir).start()
    except DataDirInUse as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    except OSError:
        print(f"port {args.port} is busy; using a free port")
        stack = LocalStack(port=0, token=args.token, data_dir=args.data_dir).start()
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"Local stack on {stack.url}, data in {stack.data_dir}")
    print(f"{args.ranks} rank processes x {args.steps} steps into run {run_id}")
    started = time.monotonic()
    spool = tempfile.mkdtemp(prefix="instantml-demo-spool-")
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(
            target=rank_process,
            args=(stack.url, stack.token, run_id, spool, rank, args.ranks, args.steps, out),
        )
        for rank in range(args.ranks)
    ]
    for process in processes:
        process.start()
    logged = dict(out.get(timeout=300) for _ in processes)
    for process in processes:
        process.join()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    elapsed = time.monotonic() - started
    print(f"{args.ranks * args.steps} rank events logged in {elapsed:.1f} s; syncing the spool")
    synced = replay.sync(Path(spool), stack.url, stack.token, timeout=300, progress=True)
    print(f"spool synced in {time.monotonic() - started:.1f} s (instantml sync exit code {synced})")

    summary = fetch_summary(stack.url, stack.token, run_id, f"step_min={max(0, args.steps - 5)}")
    print_table(summary, last_columns=5)
    problems = check(summary, logged, args.ranks)
    problems += [f"a rank process exited with {code}" for code in failed]
    problems += [f"instantml sync exited with {synced}, not 0"] if synced else []
    print()
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    if not problems:
        print(
            f"Check passed: last step coverage {args.ranks} of {args.ranks}; train/loss mean and "
            "weighted mean equal what the rank processes logged."
        )
    print(f"\nSummary JSON: {stack.url}{routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id)}")
    print(f"Distributed tab: {view_url(stack.url, PROJECT, run_id, stack.token)}")
    print(f"API token: {stack.token}")
    if args.serve:
        print("Serving until Ctrl-C.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    stack.stop()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
