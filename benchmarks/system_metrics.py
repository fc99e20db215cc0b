"""System metrics per rank (contract 2), measured side by side in one run:

    .venv/bin/python -m benchmarks.system_metrics [--quick]

1. The monitor thread's CPU (its own thread clock, ``time.pthread_getcpuclockid``) in a process logging
   100 steps/s, sampling off and sampling every second, and from them what it costs at the default 10 s;
   one sample's cost beside psutil's (what W&B and MLflow sample with), when psutil is installed.
2. ``log_rank_metrics`` median and p99 (offline mode, each call timed) with sampling off, and on every
   0.1 s (100 x the default rate, so that samples land among the timed calls).
3. 8 real processes (``tests/system_job.py``, thread mode) against ``instantml local``, one keeping 5 MiB
   a step, 10 steps/s, sampled every second (10 x the default, so that the run lasts a minute, not ten):
   the samples from the leak's start to the summary naming it, after the rule's own least evidence
   (5 samples and 100 MB), and its forecast against the truth (the rank's last sample plus the rest of
   its limit at 5 MiB a step).
4. A healthy 8-process job (rank 0 evaluating with 600 MiB more a fifth of the time), same sampling: its
   memory and GPU findings at warning or above.
5. What sampling adds at 512 ranks, from the client's batching: events and store writes a second.

The GPU paths (torch's memory, NVML) need a machine with a GPU: ``--gpu`` samples one there and prints
what it read (``torch.cuda`` initialised by the script, ``nvidia-ml-py`` installed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from instantml import settings  # noqa: E402
from instantml.api import ApiError  # noqa: E402
from instantml.monitor import system  # noqa: E402
from tests.faults import wait_for  # noqa: E402


def _monitor_cpu(every: str, seconds: float, spool: Path) -> tuple[float, int]:
    """CPU seconds of this process's monitor thread over ``seconds`` of logging, and its samples."""
    import instantml as im

    os.environ[settings.SYSTEM_INTERVAL_ENV] = every
    run = im.init(project="bench", run_id=f"cpu-{every}", upload_mode="offline", spool_dir=spool)
    run.log_rank_metrics({"loss": 1.0}, step=0, rank=0, world_size=1)
    monitor = run._lifecycle.monitor  # type: ignore[union-attr]
    clock = time.pthread_getcpuclockid(monitor.ident)
    started, cpu = time.monotonic(), time.clock_gettime(clock)
    step = 0
    while time.monotonic() - started < seconds:
        step += 1
        run.log_rank_metrics({"loss": 1.0}, step=step, rank=0, world_size=1)
        time.sleep(0.01)
    used = time.clock_gettime(clock) - cpu
    samples = monitor.samples
    run.finish()
    return used, samples


def _one_sample_us(sample: Any, n: int = 2000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        sample()
    return (time.perf_counter() - started) / n * 1e6


def monitor_cost(quick: bool, spool: Path) -> None:
    print("1. the monitor thread's CPU")
    seconds = 5.0 if quick else 20.0
    off, _ = _monitor_cpu("0", seconds, spool)
    on, samples = _monitor_cpu("1", seconds, spool)
    per_sample = max(0.0, on - off) / max(1, samples)
    at_default = off / seconds + per_sample / settings.DEFAULT_SYSTEM_INTERVAL_S
    print(f"  sampling off: {off / seconds * 100:.4f}% of a core (its wake-up each second)")
    print(
        f"  sampling every 1 s: {on / seconds * 100:.4f}% of a core, {samples} samples, "
        f"{per_sample * 1e6:.0f} us each"
    )
    print(f"  at the default 10 s: {at_default * 100:.4f}% of a core (goal < 0.1%)")
    ours = _one_sample_us(system.Sampler().sample)
    try:
        import psutil

        proc = psutil.Process()
        theirs = _one_sample_us(lambda: (proc.memory_info(), proc.cpu_percent()))
        print(
            f"  one sample: {ours:.1f} us here; psutil's memory_info + cpu_percent {theirs:.1f} us "
            f"({ours / theirs:.2f}x)"
        )
    except ImportError:
        print(f"  one sample: {ours:.1f} us here; psutil not installed (no comparison)")


def hot_path(quick: bool, spool: Path) -> None:
    import instantml as im

    print("\n2. log_rank_metrics, each call timed (offline mode)")
    calls = 20_000 if quick else 50_000
    runs: dict[str, list[tuple[float, float, int]]] = {"sampling off": [], "sampling every 0.1 s": []}
    for rep in range(3):  # alternating, so that neither side has the warmer process
        for label, every in (("sampling off", "0"), ("sampling every 0.1 s", "0.1")):
            os.environ[settings.SYSTEM_INTERVAL_ENV] = every
            run = im.init(
                project="bench", run_id=f"hot-{every}-{rep}", upload_mode="offline", spool_dir=spool
            )
            times = []
            metrics = {"train/loss": 0.5, "train/tokens": 4096.0}
            for step in range(calls):
                t = time.perf_counter_ns()
                run.log_rank_metrics(metrics, step=step, rank=0, world_size=1)
                times.append(time.perf_counter_ns() - t)
                if step % 1000 == 0:
                    time.sleep(0.002)  # (the monitor gets its turns, as between real steps)
            samples = run._lifecycle.monitor.samples  # type: ignore[union-attr]
            run.finish()
            times.sort()
            runs[label].append((times[len(times) // 2] / 1e3, times[int(len(times) * 0.99)] / 1e3, samples))
    results = {}
    for label, each in runs.items():
        median = statistics.median(m for m, _, _ in each)
        p99 = statistics.median(p for _, p, _ in each)
        results[label] = (median, p99, sum(n for _, _, n in each))
        shown = ", ".join(f"{m:.2f}" for m, _, _ in each)
        print(
            f"  {label}: median {median:.2f} us (runs: {shown}), p99 {p99:.2f} us, "
            f"{results[label][2]} samples"
        )
    (m0, p0, _), (m1, p1, _) = results.values()
    print(f"  ratio on/off (medians of 3 alternating runs): median {m1 / m0:.2f}x, p99 {p1 / p0:.2f}x")


def _start_job(stack: Any, run_id: str, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    environ = {
        **os.environ,
        "INSTANTML_API_URL": stack.url,
        "INSTANTML_API_KEY": stack.token,
        "INSTANTML_SYSTEM_INTERVAL_S": "1",
        "PROJECT": "system-bench",
        "RUN_ID": run_id,
        "WORLD_SIZE": "8",
        **env,
    }
    environ.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "tests.system_job"]
    return [subprocess.Popen(command, cwd=ROOT, env={**environ, "RANK": str(r)}) for r in range(8)]


def leak(stack: Any, quick: bool) -> None:
    import numpy as np

    import instantml as im

    print("\n3. one rank of 8 keeping 5 MiB a step (10 steps/s, a sample a second)")
    steps = 300 if quick else 600
    knobs = {"STEPS": str(steps), "STEP_S": "0.1", "LEAK_RANK": "5", "LEAK_MB": "5"}
    procs = _start_job(stack, "leak", knobs)
    api = im.Api(stack.url, stack.token)
    started, found = time.monotonic(), None
    while found is None and any(p.poll() is None for p in procs):
        try:
            rows = api.run("system-bench", "leak").summary(keys="system/rss_mb,system/memory_limit_mb")
            rows = rows["findings"]
        except ApiError:  # (no events yet)
            rows = []
        hits = [f for f in rows if f["kind"] == "memory_growth"]
        if hits:
            found = (time.monotonic() - started, hits, time.time())
        time.sleep(0.25)
    for p in procs:
        p.wait(timeout=300)
    run = api.run("system-bench", "leak")
    if found is None:
        print("  not found while the job ran")
        return
    took, hits, found_at = found
    names = sorted({f["rank"] for f in hits})
    print(f"  named {took:.1f} s after the job started: ranks {names} (the leak is rank 5's)")
    frame = run.rank_metrics(keys=["system/rss_mb"], ranks=[5]).to_pandas().sort_values("step")
    fifth = frame.iloc[4]  # the rule's least evidence: 5 samples (and 100 MB, which 2 samples hold here)
    late = found_at - float(fifth["time"])
    print(
        f"  the 5th sample (step {int(fifth['step'])}) was taken {late:.1f} s before it was named: {late:.1f}"
    )
    print("  intervals, the upload's linger and the summary's reads included (goal <= 3)")
    row = hits[0]
    values = run.rank_metrics(keys=["system/rss_mb", "system/memory_limit_mb"])
    rss, limit = values.to_numpy("system/rss_mb"), values.to_numpy("system/memory_limit_mb")
    cols = np.array(values.steps("system/rss_mb"))
    i = min(int(np.searchsorted(cols, int(row["step"]))), len(cols) - 1)  # the row's last sample
    truth = cols[i] + (limit[5, i] - rss[5, i]) / 5.0
    if "forecast_step" in row:
        off = (row["forecast_step"] - truth) / (truth - cols[i])
        print(
            f"  forecast: step {row['forecast_step']:,} against the truth {truth:,.0f} "
            f"(from step {cols[i]}): "
            f"{off * 100:+.1f}% of the steps ahead (goal within 10%)"
        )
    print(f"  its words: {row['message']}")


def healthy(stack: Any, quick: bool) -> None:
    import instantml as im

    print("\n4. a healthy job, 8 processes, rank 0 evaluating (600 MiB more a fifth of the time)")
    steps = 300 if quick else 600
    knobs = {"STEPS": str(steps), "STEP_S": "0.1", "EVAL_EVERY": "100", "EVAL_MB": "600"}
    procs = _start_job(stack, "healthy", knobs)
    for p in procs:
        p.wait(timeout=300)
    run = im.Api(stack.url, stack.token).run("system-bench", "healthy")

    def complete() -> dict[str, Any] | None:
        summary: dict[str, Any] = run.summary()
        return summary if summary["coverage"]["reported"][-1:] == [8] else None  # (a dict: truthy)

    rows = wait_for(complete, 300, "the healthy job's summary")["findings"]
    kinds = ("memory_growth", "memory_high", "gpu_idle")
    loud = [f for f in rows if f["severity"] in ("warning", "critical") and f["kind"] in kinds]
    print(
        f"  memory and GPU findings at warning or above: {len(loud)} (goal 0) {[f['message'] for f in loud]}"
    )
    others = [f["kind"] for f in rows if f["severity"] in ("warning", "critical") and f["kind"] not in kinds]
    print(f"  other findings at warning or above: {others}")


def at_scale() -> None:
    print("\n5. at 512 ranks")
    every = settings.DEFAULT_SYSTEM_INTERVAL_S
    events = 512 / every
    print(f"  {events:.1f} more events a second (one a rank each {every:.0f} s); 512 a second at 1 step/s")
    print(
        "  requests: none of their own; a sample joins the batch the rank's next upload sends (thread mode:"
    )
    print("  up to 500 events or the linger; spool: the uploader's batches), so requests/s stay as they are;")
    more = events / 512 * 100
    print(
        f"  store writes: {events:.1f} items a second more (+{more:.0f}% at 1 step/s, +{more / 5:.0f}% at 5)"
    )


def gpu() -> None:
    import torch

    torch.zeros(1, device="cuda")  # (this script initialises CUDA; the sampler never does)
    sampler = system.Sampler(int(os.environ.get("LOCAL_RANK", "0")))
    time.sleep(1)
    for key, value in sorted(sampler.sample().items()):
        print(f"  {key}: {value:,.1f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="sample this machine's GPU through torch and NVML")
    args = parser.parse_args()
    if args.gpu:
        gpu()
        return 0
    from infra.local import LocalStack

    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp) / "spool"
        monitor_cost(args.quick, spool)
        hot_path(args.quick, spool)
        os.environ.pop(settings.SYSTEM_INTERVAL_ENV, None)
        stack = LocalStack(port=0, data_dir=Path(tmp) / "stack").start()
        try:
            leak(stack, args.quick)
            healthy(stack, args.quick)
        finally:
            stack.stop()
    at_scale()
    return 0


if __name__ == "__main__":
    sys.exit(main())
