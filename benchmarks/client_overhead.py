"""What logging costs the training process, side by side in one run (see shared benchmarks notes).

    make bench     # or: .venv/bin/python benchmarks/client_overhead.py [--steps N] [--rounds N] [--events N]

1. ``log_rank_metrics`` per call (2-key metric dict), median and p99 over ``--steps`` calls x
   ``--rounds``, each tool in a fresh process: the floor (uuid4 + time_ns + orjson.dumps + os.write),
   spool mode (with its uploader process live: on 2 cores it and the local stack compete with the
   timed process), offline mode (the same writer, no uploader running), the in-process thread mode
   (uploading to the local stack meanwhile), and wandb offline / tensorboardX where
   ``.cache/venv-bench`` has them.
2. ``import instantml`` in a fresh interpreter, and which heavy modules it loads.
3. Uploader throughput: ``instantml sync`` of a spool of ``--events`` events into the local stack
   (``--events 0`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = ROOT / ".cache" / "venv-bench" / "bin" / "python"


def worker(tool: str, steps: int, rounds: int, workdir: str) -> None:
    """Time ``steps`` calls of one tool, ``rounds`` times; print JSON with per-round figures."""
    rows = []
    values = [(1.0 / (i + 1), 3.0 + i % 7) for i in range(steps)]
    log = _setup(tool, workdir)
    clock = time.perf_counter_ns
    for _ in range(rounds):
        times = [0] * steps
        started = clock()
        for step in range(steps):
            loss, grad = values[step]
            t0 = clock()
            log(step, loss, grad)
            times[step] = clock() - t0
        total = clock() - started
        times.sort()
        rows.append(
            {
                "median_us": times[steps // 2] / 1000,
                "p99_us": times[int(steps * 0.99)] / 1000,
                "mean_us": total / steps / 1000,
            }
        )
    print(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)  # no flush-at-exit work of any tool inside the figures' process lifetime


def _setup(tool: str, workdir: str):  # type: ignore[no-untyped-def]
    if tool == "floor":
        import uuid

        try:
            import orjson

            dumps = orjson.dumps
        except ImportError:  # the floor without orjson: stdlib json
            dumps = lambda obj: json.dumps(obj).encode()  # noqa: E731
        fd = os.open(os.path.join(workdir, "floor.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def floor(step: int, loss: float, grad: float) -> None:
            event = {
                "event_id": uuid.uuid4().hex,
                "time": time.time_ns(),
                "step": step,
                "metrics": {"train/loss": loss, "optimizer/grad_norm": grad},
            }
            os.write(fd, dumps(event) + b"\n")

        return floor
    mode, _, method = tool.partition(":")
    if mode in ("spool", "offline", "thread"):
        import instantml as im

        run = im.init(project="bench", run_id=f"bench-{mode}", upload_mode=mode, spool_dir=workdir)

        def ours(step: int, loss: float, grad: float) -> None:
            run.log_rank_metrics(
                {"train/loss": loss, "optimizer/grad_norm": grad}, step=step, rank=0, world_size=8, weight=32
            )

        def ours_scalars(step: int, loss: float, grad: float) -> None:
            run.log({"train/loss": loss, "optimizer/grad_norm": grad}, step=step)

        return ours_scalars if method == "log" else ours
    if tool == "wandb":
        import wandb

        wrun = wandb.init(project="bench", mode="offline", dir=workdir)

        def wb(step: int, loss: float, grad: float) -> None:
            wrun.log({"train/loss": loss, "optimizer/grad_norm": grad}, step=step)

        return wb
    if tool == "tensorboardX":
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(workdir)

        def tbx(step: int, loss: float, grad: float) -> None:
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("optimizer/grad_norm", grad, step)

        return tbx
    raise SystemExit(f"unknown tool {tool}")


def run_worker(
    python: str, tool: str, steps: int, rounds: int, env: dict[str, str]
) -> list[dict[str, float]] | str:
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [
            python,
            __file__,
            "--worker",
            tool,
            "--steps",
            str(steps),
            "--rounds",
            str(rounds),
            "--dir",
            workdir,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if tool.startswith("spool"):  # the uploader this run started: ours to stop
            lock = Path(workdir) / "uploader.lock"
            if lock.exists() and lock.read_text().strip().isdigit():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(lock.read_text()), signal.SIGTERM)
        if result.returncode != 0:
            return (result.stderr.strip().splitlines() or ["failed"])[-1]
        return json.loads(result.stdout.strip().splitlines()[-1])


def has(python: Path, module: str) -> bool:
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def import_time(python: str, runs: int = 15) -> tuple[float, list[str]]:
    code = (
        "import time, sys; t = time.perf_counter(); import instantml; d = time.perf_counter() - t; "
        "print(d * 1000, [m for m in ('numpy', 'pydantic', 'boto3', 'botocore') if m in sys.modules])"
    )
    times = []
    heavy: list[str] = []
    for _ in range(runs):
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split(
            " ", 1
        )
        times.append(float(out[0]))
        heavy = json.loads(out[1].replace("'", '"'))
    return statistics.median(times), heavy


def throughput(events: int, env: dict[str, str], url: str) -> tuple[float, float, int]:
    """Write ``events`` events (8 ranks) to an offline spool, then time ``instantml sync`` of it."""
    import instantml as im

    with tempfile.TemporaryDirectory() as spool_dir:
        run = im.init(
            project="bench", run_id="throughput", upload_mode="offline", spool_dir=spool_dir, api_url=url
        )
        for i in range(events):
            run.log_rank_metrics(
                {"train/loss": 1.0 / (i + 1), "optimizer/grad_norm": 3.0},
                step=i // 8,
                rank=i % 8,
                world_size=8,
            )
        run.finish()
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "instantml.cli", "sync", spool_dir, "--quiet"]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        elapsed = time.perf_counter() - started
        return events / elapsed, elapsed, result.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--dir")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.rounds, args.dir)
        return

    sys.path.insert(0, str(ROOT))
    from infra.local import LocalStack

    stack = LocalStack(port=0).start()
    env = dict(os.environ, INSTANTML_API_URL=stack.url, INSTANTML_API_KEY=stack.token, WANDB_SILENT="true")
    # Every tool in one interpreter: the bench venv (wandb, tensorboardX, orjson) when `make bench` made it.
    python = str(BENCH_PYTHON) if BENCH_PYTHON.exists() else sys.executable
    version = subprocess.run([python, "-V"], capture_output=True, text=True).stdout.strip()
    print(f"{version} ({python}), {os.cpu_count()} cores; {args.steps:,} steps x {args.rounds} rounds")
    print(f"{'tool':<34} {'median us':>10} {'p99 us':>10} {'mean us':>10} {'median / floor':>15}")
    floor = "floor (uuid4+time_ns+orjson+os.write)" if has(Path(python), "orjson") else "floor (stdlib json)"
    tools: list[tuple[str, str, str]] = [
        (floor, python, "floor"),
        ("instantml spool (uploader live)", python, "spool"),
        ("instantml offline (same writer)", python, "offline"),
        ("instantml thread (uploading)", python, "thread"),
        ("instantml spool run.log", python, "spool:log"),
        ("instantml offline run.log", python, "offline:log"),
        ("instantml thread run.log", python, "thread:log"),
    ]
    skipped = []
    for label, module in (
        ("wandb offline (run.log)", "wandb"),
        ("tensorboardX add_scalar x2", "tensorboardX"),
    ):
        if has(Path(python), module):
            tools.append((label, python, module))
        else:
            skipped.append(
                f"{module} (not installed; `make bench` installs it in {BENCH_PYTHON.parent.parent})"
            )
    floor_median = None
    medians: dict[str, float] = {}
    for label, python, tool in tools:
        rows = run_worker(python, tool, args.steps, args.rounds, env)
        if isinstance(rows, str):
            print(f"{label:<34} failed: {rows}")
            continue
        median = statistics.median(r["median_us"] for r in rows)
        p99 = statistics.median(r["p99_us"] for r in rows)
        mean = statistics.median(r["mean_us"] for r in rows)
        floor_median = floor_median or median
        medians[tool] = median
        print(f"{label:<34} {median:>10.2f} {p99:>10.2f} {mean:>10.2f} {median / floor_median:>14.1f}x")
    for mode in ("spool", "offline", "thread"):  # issue 15's goal: run.log within 1.2x
        if mode in medians and f"{mode}:log" in medians:
            ratio = medians[f"{mode}:log"] / medians[mode]
            verdict = "within" if ratio <= 1.2 else "OVER"
            print(f"run.log / log_rank_metrics, {mode}: {ratio:.2f}x ({verdict} the 1.2x goal)")
    for note in skipped:
        print(f"skipped: {note}")

    ms, heavy = import_time(python)
    print(
        f"import instantml: {ms:.1f} ms (median of 15 fresh interpreters); heavy modules: {heavy or 'none'}"
    )

    if args.events <= 0:
        stack.stop()
        return
    rate, elapsed, code = throughput(args.events, env, stack.url)
    print(
        f"uploader throughput: {args.events:,} events in {elapsed:.1f} s = {rate:,.0f} events/s (exit {code})"
    )
    stack.stop()


if __name__ == "__main__":
    main()
