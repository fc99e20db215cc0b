"""The demo: the local stack, a simulated 8-rank job through the real client, and its summary.

    python -m infra.demo [--serve] [--port 8787] [--ranks 8] [--steps 200]

Each rank is its own OS process that logs ``train/loss``, ``optimizer/grad_norm`` and
``system/step_time`` with an uneven weight (its batch size), into two runs side by side: a clean one,
and one with the faults the Distributed tab is for (``FAULTS``: a rank that stops, a slow rank, a bad
shard's loss spikes). The demo then reads both runs' Distributed summaries over HTTP, prints the clean
run's last steps as a table and both runs' findings, and checks that the clean run's last step has full
coverage, that its mean and weighted mean of ``train/loss`` equal what the rank processes logged and
that it raises no warning, and that the faulty run's findings name each fault's rank.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from infra.local import DataDirInUse, LocalStack, compare_url, run_url, runs_url, view_url
from instantml import routes
from instantml.commands.sync import sync
from instantml.upload import spool as spool_lib
from instantml.upload.background import uploader_running

PROJECT = "distributed-job"
KEYS = ("train/loss", "optimizer/grad_norm", "system/step_time")
#: The faulty run's faults: (the rank, the finding that must name it: kind, key).
FAULTS = {
    "stops at 60% of the steps": (5, "stopped_reporting", None),
    "30% slower steps": (3, "persistent_outlier", "system/step_time"),
    "8x loss at two steps (a bad shard)": (6, "spike", "train/loss"),
}


def batch_size(rank: int) -> int:
    return 1024 - 96 * rank  # uneven on purpose: the weighted mean differs from the mean


def rank_process(
    api_url: str,
    token: str,
    run_ids: tuple[str, str],
    spool: str,
    rank: int,
    world_size: int,
    steps: int,
    out: Any,
) -> None:
    """One training process: logs every step of the clean and the faulty run through the real client,
    reports the clean run's last values."""
    import instantml as im

    rng = random.Random(rank)
    grad_rng = random.Random(0)  # all-reduced: the same on every rank
    last: dict[str, float] = {}
    stop, slow, spiky = (rank == FAULTS[f][0] for f in FAULTS)

    # As a launcher (torchrun, SLURM) sets them: the client then says this rank's host once, at init,
    # and the findings about the rank name it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))

    def init(run_id: str) -> Any:
        return im.init(
            project=PROJECT,
            run_id=run_id,
            upload_mode="spool",
            spool_dir=spool,
            api_url=api_url,
            api_key=token,
            config={"model": "demo-mlp", "lr": 3e-4, "world_size": world_size, "steps": steps},
        )

    with init(run_ids[0]) as clean, init(run_ids[1]) as faulty:
        for step in range(steps):
            last = {
                "train/loss": 2.4 * math.exp(-step / 60) + 0.2 + rng.gauss(0, 0.02),
                "optimizer/grad_norm": 3.0 + grad_rng.gauss(0, 0.3),
                "system/step_time": 0.25 + abs(rng.gauss(0, 0.01)),
            }
            clean.log_rank_metrics(last, step=step, rank=rank, world_size=world_size, weight=batch_size(rank))
            if rank == 0:  # the run's ordinary scalars, as a trainer logs them from one process
                lr = 3e-4 * min(1.0, (step + 1) / 20)
                clean.log({"train/loss": last["train/loss"], "lr": lr}, step=step)
                faulty.log({"train/loss": last["train/loss"], "lr": lr}, step=step)
            if stop and step >= steps * 0.6:
                continue
            bad = dict(last)
            if slow:
                bad["system/step_time"] *= 1.3
            if spiky and step in (steps // 2, steps // 2 + 1):
                bad["train/loss"] *= 8
            faulty.log_rank_metrics(bad, step=step, rank=rank, world_size=world_size, weight=batch_size(rank))
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


def print_findings(summary: dict[str, Any], which: str) -> None:
    findings = summary["findings"]
    print(f"\nFindings of {which}:" if findings else f"\nFindings of {which}: none")
    for finding in findings:
        print(f"  [{finding['severity']}] {finding['message']}")


def check(
    summary: dict[str, Any], whole: dict[str, Any], logged: dict[int, dict[str, float]], world_size: int
) -> list[str]:
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
    problems += [
        f"the clean run raised a {f['severity']} finding: {f['message']}"
        for f in whole["findings"]
        if f["severity"] != "info"
    ]
    return problems


def check_faults(summary: dict[str, Any]) -> list[str]:
    """Each fault of the faulty run is named by a finding of its kind on its rank (and key)."""
    found = {(f["kind"], f["rank"], f["key"]) for f in summary["findings"] if f["severity"] != "info"}
    return [
        f"the faulty run's rank {rank} ({fault}) is not named by a {kind} finding"
        for fault, (rank, kind, key) in FAULTS.items()
        if (kind, rank, key) not in found
    ]


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
    # SIGTERM (a process manager, `timeout`, `kill`) stops the stack as Ctrl-C does: its worker pools and
    # queues are shut down, which a process killed outright leaves to the resource tracker ("23 leaked
    # semaphore objects").
    signal.signal(signal.SIGTERM, _interrupt)
    code = 130  # stopped before the demo was done
    try:
        code = run_demo(stack, args)
        if args.serve:
            print("Serving until Ctrl-C.", flush=True)
            while True:
                time.sleep(3600)
        print(
            "\nThe demo stops its server now: these pages need one. `make serve` runs the demo again and "
            f"keeps serving until Ctrl-C (the same data in {stack.data_dir}, so these runs are there too, "
            "and the same token)."
        )
    except KeyboardInterrupt:
        pass  # Ctrl-C or SIGTERM: how a served demo ends
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut the stop short
        stack.stop()
    return code


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_demo(stack: LocalStack, args: argparse.Namespace) -> int:
    """The demo's runs on a started stack, their checks and links: 0 when every check passed."""
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    faulty_id = f"{run_id}-faults"
    print(f"Local stack on {stack.url}, data in {stack.data_dir}")
    print(f"{args.ranks} rank processes x {args.steps} steps into runs {run_id} (clean) and {faulty_id}:")
    for fault, (rank, _, _) in FAULTS.items():
        print(f"  {faulty_id}: rank {rank} {fault}")
    stopping = FAULTS["stops at 60% of the steps"][0]
    started = time.monotonic()
    spool = tempfile.mkdtemp(prefix="instantml-demo-spool-")
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(
            target=rank_process,
            args=(stack.url, stack.token, (run_id, faulty_id), spool, rank, args.ranks, args.steps, out),
        )
        for rank in range(args.ranks)
    ]
    for process in processes:
        process.start()
    logged = dict(out.get(timeout=300) for _ in processes)
    for process in processes:
        process.join()
    out.close()  # its lock and semaphores go now, not at exit
    out.join_thread()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    logged_events = args.ranks * args.steps * 2 - sum(
        1
        for rank in range(args.ranks)
        for step in range(args.steps)
        if rank == stopping and step >= args.steps * 0.6
    )
    print(f"{logged_events} rank events (both runs) logged in {time.monotonic() - started:.1f} s")
    spool_dir = Path(spool)
    left = sum(spool_lib.pending_lines(path) for path in spool_lib.spool_files(spool_dir))
    synced_at = time.monotonic()
    if left:
        print(f"{left} of them still in the spool: instantml sync sends them")
    else:
        print("the uploader process had already sent them all; instantml sync checks that nothing is left")
    synced = sync(spool_dir, stack.url, stack.token, timeout=300, progress=bool(left))
    print(f"instantml sync exit code {synced} after {time.monotonic() - synced_at:.1f} s")
    deadline = time.monotonic() + 30
    while uploader_running(spool_dir) and time.monotonic() < deadline:  # it exits once empty
        time.sleep(0.1)
    if not uploader_running(spool_dir):
        shutil.rmtree(spool_dir, ignore_errors=True)

    summary = fetch_summary(stack.url, stack.token, run_id, f"step_min={max(0, args.steps - 5)}")
    print_table(summary, last_columns=5)
    whole, faulty = (fetch_summary(stack.url, stack.token, run, "") for run in (run_id, faulty_id))
    print_findings(whole, f"{run_id} (clean)")
    print_findings(faulty, faulty_id)
    problems = check(summary, whole, logged, args.ranks) + check_faults(faulty)
    problems += [f"a rank process exited with {code}" for code in failed]
    problems += [f"instantml sync exited with {synced}, not 0"] if synced else []
    print()
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    if not problems:
        print(
            f"Check passed: last step coverage {args.ranks} of {args.ranks}; train/loss mean and "
            "weighted mean equal what the rank processes logged; no warning on the clean run, and "
            "each fault of the faulty run named on its rank."
        )
    print_links(stack, args.token is None, run_id, faulty_id)
    return 1 if problems else 0


def print_links(stack: LocalStack, token_saved: bool, run_id: str, faulty_id: str) -> None:
    """The pages of the demo's runs, and its summary as JSON. A page link carries the token in its fragment
    (the page keeps it in the browser and takes it out of the address bar); the JSON needs the token as a
    header, which a browser's address bar cannot send: a curl command, reading the token from its file
    rather than putting it on the command line."""
    token_file = stack.data_dir / "token"
    bearer = f"$(cat {token_file})" if token_saved and token_file.exists() else stack.token
    summary = f"{stack.url}{routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id)}"
    print(f'\nSummary JSON: curl -H "Authorization: Bearer {bearer}" {summary}')
    print(f"Runs page: {runs_url(stack.url, PROJECT, stack.token)}")
    for which, run in (("clean", run_id), ("faulty", faulty_id)):
        print(f"Run page, {which} run: {run_url(stack.url, PROJECT, run, stack.token)}")
        print(f"Distributed tab, {which} run: {view_url(stack.url, PROJECT, run, stack.token)}")
    print(f"Both runs side by side: {compare_url(stack.url, PROJECT, [run_id, faulty_id], stack.token)}")
    print(f"API token: {stack.token} (kept in {token_file})" if token_saved else f"API token: {stack.token}")
    print(
        "Whichever link is opened first signs this browser in (the token leaves the address bar); the pages"
    )
    print("and links opened from it then need no token, in any tab, until Sign out.")


if __name__ == "__main__":
    sys.exit(main())
