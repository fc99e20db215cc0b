"""The watch (contract 7): how soon a person hears of a stopped rank or a hung job, how quiet it stays
on healthy jobs, and what a round costs beside ingest.

    .venv/bin/python -m benchmarks.watch [--quick] [--jobs 2] [--only quality,latency,round]

- quality (in-process, simulated clock): the jobs of ``benchmarks/findings_quality.py`` (tests/jobs.py)
  replayed as live streams (tests/live.py: a real SQLite store, uploads up to 2 s late, an evaluation
  pause of 90 s every 60 steps, rounds every 10 s): alerts at ``warning`` or above over the healthy
  jobs, beside the ``warning``/``critical`` rows of the offline summary of the same jobs; and for the
  faults at their clear size, the share alerted with the right kind and rank (a webhook at ``info``
  hears every onset; at ``warning``, the warning ones), beside the share the offline summary finds.
- latency (the real local stack, default settings: a round every 10 s): jobs of 8 and 64 ranks at 1 to
  4 steps/s, driven over HTTP by one thread per job (every rank's event of a step in one batch, as
  spool uploaders do); one rank stops halfway, the others go on. The time from that rank's last event
  to the ``opened`` POST at a real webhook receiver, median and max of 10 jobs per size; and a 1 step/s
  job whose every rank hangs: from its last event to the ``stalled`` alert.
- round: 50 live runs of 512 ranks x 4 keys on the real local stack, every run logging a step every 2 s;
  the watch function runs six rounds 10 s apart (the stack's own worker, as its schedule would; the
  first summarizes every run, the next ones the runs whose last summary is ``SUMMARY_EVERY_S`` old):
  each round's time, and the p99 of ingest batches posted during rounds against those outside them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.drivers import QuietHandler, serve  # noqa: E402
from benchmarks.findings_quality import HEALTHY_RANKS, Case  # noqa: E402
from shared.summary.decoding import decode  # noqa: E402
from shared.summary.document import summarize  # noqa: E402
from shared.summary.query import SummaryQuery  # noqa: E402
from tests.jobs import CLEAR_SIZE, MODELS  # noqa: E402
from tests.live import replay  # noqa: E402

PAUSE_EVERY, PAUSE_S = 60, 90.0
FAULTS = ("stopped", "nan_once", "desync", "slow", "noisy", "spikes", "gaps")


# ---------------------------------------------------------------- quality


@dataclass(frozen=True)
class Judged:
    case: Case
    live_alarms: int  # alerts at warning or above that the job does not expect
    offline_alarms: int  # warning/critical rows of the offline summary that the job does not expect
    alerted_any: bool  # every expected finding opened an alert (a webhook at info)
    alerted_warning: bool  # ... at warning or above
    found_offline: bool
    failed: int


def judge(case: Case) -> Judged:
    job = case.job()
    whole = summarize(decode(job.events), "p", "r", SummaryQuery())["findings"]
    with tempfile.TemporaryDirectory() as tmp:
        outcome = replay(
            job, Path(tmp) / "db", pause_every=PAUSE_EVERY, pause_s=PAUSE_S, lag_s=2.0, seed=case.seed
        )
    accepted = job.accepted()

    def opened(min_severity: str) -> set[tuple[str, int | None, str | None]]:
        return {
            (x.finding["kind"], x.finding["rank"], x.finding["key"]) for _, x in outcome.alerts(min_severity)
        }

    def all_there(seen: set[tuple[str, int | None, str | None]]) -> bool:
        return bool(job.expected) and all(
            any((kind, e.rank, e.key) in seen for kind in (e.kind, *job.aliases.get(e.kind, ())))
            for e in job.expected
        )

    return Judged(
        case,
        len([a for a in opened("warning") if a not in accepted]),
        len(job.unexpected(whole)),
        all_there(opened("info")),
        all_there(opened("warning")),
        not job.missed(whole),
        len(outcome.failed),
    )


def quality_cases(quick: bool) -> tuple[list[Case], list[Case]]:
    healthy = []
    for model in MODELS:
        for ranks in HEALTHY_RANKS:
            seeds = (1 if ranks >= 512 else 2) if quick else (1 if ranks >= 512 else 6)
            healthy += [Case(model, ranks, 200, seed) for seed in range(seeds)]
    faults = [
        Case("realistic", ranks, 200, seed, fault, CLEAR_SIZE[fault])
        for fault in FAULTS
        for ranks in (8, 64)
        for seed in range(2 if quick else 6)
    ]
    return healthy, faults


def run_quality(quick: bool, workers: int) -> None:
    healthy, faults = quality_cases(quick)
    started = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        judged = pool.map(judge, healthy + faults, chunksize=1)
    print(
        f"\n## quality: {len(healthy)} healthy and {len(faults)} faulty jobs replayed live "
        f"({time.perf_counter() - started:.0f} s, {workers} workers)"
    )
    ok = [j for j in judged if j.case.fault is None]
    print(f"pause of {PAUSE_S:.0f} s every {PAUSE_EVERY} steps, uploads up to 2 s late, a round every 10 s")
    print(f"{'healthy jobs':<28} {'live alerts >= warning':>24} {'offline warning rows':>22}")
    by_ranks: dict[int, list[Judged]] = defaultdict(list)
    for j in ok:
        by_ranks[j.case.ranks].append(j)
    for ranks, group in sorted(by_ranks.items()):
        live = sum(j.live_alarms for j in group)
        offline = sum(j.offline_alarms for j in group)
        print(f"{f'{len(group)} jobs x {ranks} ranks':<28} {live:>24} {offline:>22}")
    live, offline = sum(j.live_alarms for j in ok), sum(j.offline_alarms for j in ok)
    print(f"{f'all {len(ok)} jobs':<28} {live:>24} {offline:>22}")
    print(f"rounds that failed: {sum(j.failed for j in judged)}")
    head = ("fault (clear size)", "jobs", "alerted (info)", "alerted (warning)", "found offline")
    print(f"\n{head[0]:<24} {head[1]:>5} {head[2]:>15} {head[3]:>18} {head[4]:>14}")
    by_fault: dict[str, list[Judged]] = defaultdict(list)
    for j in judged:
        if j.case.fault is not None:
            by_fault[j.case.fault].append(j)
    for fault, group in by_fault.items():
        n = len(group)

        def share(flag: str, group: list[Judged] = group, n: int = n) -> str:
            return f"{sum(getattr(j, flag) for j in group) / n:.0%}"

        print(
            f"{f'{fault} ({CLEAR_SIZE[fault]:g})':<24} {n:>5} {share('alerted_any'):>15} "
            f"{share('alerted_warning'):>18} {share('found_offline'):>14}"
        )


# ---------------------------------------------------------------- the real local stack


class Receiver:
    """A webhook receiver: the time each alert arrived."""

    def __init__(self) -> None:
        self.alerts: list[tuple[float, dict[str, Any]]] = []
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.alerts.append((time.time(), body))
                self.send(200, b"", "application/json")

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def first(self, run_id: str, kind: str) -> float | None:
        for at, body in self.alerts:
            if body["run_id"] == run_id and body["state"] == "opened" and body["finding"]["kind"] == kind:
                return at
        return None


def post(url: str, token: str, path: str, body: Any, method: str = "POST") -> float:
    """One request; its latency in seconds."""
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def drive(
    stack: Any, project: str, run_id: str, ranks: int, rate: float, steps: int, stop: dict[str, Any]
) -> None:
    """A job at ``rate`` steps/s: each step, every live rank's event in one batch. ``stop``: the rank
    that stops and at which step (its last event's time is recorded), or ``hang`` at a step (every rank
    silent from then on); the job ends after ``steps`` or once ``stop["done"]`` is set."""
    batch = f"/v1/projects/{project}/runs/{run_id}/rank-metrics/batch"
    started = time.time()
    for step in range(steps):
        if stop.get("done") or (stop.get("hang") is not None and step > stop["hang"]):
            break
        now = time.time()
        events = []
        for rank in range(ranks):
            if stop.get("rank") == rank and step > stop["at"]:
                continue
            events.append(
                {
                    "event_id": f"{run_id}-{step}-{rank}",
                    "step": step,
                    "rank": rank,
                    "world_size": ranks,
                    "local_rank": rank % 8,
                    "time": now,
                    "metrics": {
                        "train/loss": 2.0 / (1 + step) * (1 + 0.01 * ((rank * 7 + step) % 5)),
                        "system/step_time": 1.0 / rate * (1 + 0.02 * ((rank + step) % 3)),
                    },
                }
            )
        post(stack.url, stack.token, batch, {"events": events})
        if stop.get("rank") is not None and step == stop["at"]:
            stop["last_event"] = now
        if stop.get("hang") == step:
            stop["last_event"] = now
        time.sleep(max(0.0, started + (step + 1) / rate - time.time()))


def run_latency(quick: bool) -> None:
    from infra.local import WATCH_INTERVAL_S, LocalStack

    receiver = Receiver()
    with tempfile.TemporaryDirectory() as tmp, LocalStack(port=0, data_dir=tmp) as stack:
        stack.wait_ready()
        project = "bench-watch"
        post(
            stack.url,
            stack.token,
            f"/v1/projects/{project}/alerts",
            {"webhooks": [{"url": receiver.url}]},
            "PUT",
        )
        jobs = []
        per_size = 3 if quick else 10
        for ranks in (8, 64):
            for i in range(per_size):
                rate = (1.0, 2.0, 4.0)[i % 3]
                # stops spread over a round's 10 s, so that the jobs see every phase of the schedule
                stop = {"rank": (i * 5) % ranks, "at": int((20 + 10 * i / per_size) * rate)}
                jobs.append((f"stop-{ranks}-{i}", ranks, rate, stop, "stopped_reporting"))
        jobs.append(("hang-8", 8, 1.0, {"hang": 30}, "stalled"))
        threads = []
        for run_id, ranks, rate, stop, _ in jobs:
            steps = 100_000 if "rank" in stop else 10_000
            thread = threading.Thread(
                target=drive, args=(stack, project, run_id, ranks, rate, steps, stop), daemon=True
            )
            thread.start()
            threads.append(thread)
        deadline = time.time() + 600
        while time.time() < deadline:
            pending = [j for j in jobs if receiver.first(j[0], j[4]) is None]
            for run_id, _, _, stop, kind in jobs:
                if receiver.first(run_id, kind) is not None:
                    stop["done"] = True
            if not pending:
                break
            time.sleep(0.5)
        for _, _, _, stop, _ in jobs:
            stop["done"] = True
        for thread in threads:
            thread.join(timeout=30)
        print(f"\n## latency on the local stack (a round every {WATCH_INTERVAL_S:g} s, the default)")
        print(f"{'jobs':<34} {'median':>8} {'max':>8} {'missed':>7}")
        for ranks in (8, 64):
            waits, missed = [], 0
            for run_id, r, _, stop, kind in jobs:
                if r != ranks or kind != "stopped_reporting":
                    continue
                at = receiver.first(run_id, kind)
                if at is None:
                    missed += 1
                else:
                    waits.append(at - stop["last_event"])
            label = f"{ranks} ranks, 1-4 steps/s, rank stops"
            med = f"{statistics.median(waits):.1f} s" if waits else "-"
            top = f"{max(waits):.1f} s" if waits else "-"
            print(f"{label:<34} {med:>8} {top:>8} {missed:>7}")
        _, _, _, stop, _ = jobs[-1]
        at = receiver.first("hang-8", "stalled")
        hang = "not alerted in 10 min" if at is None else f"{at - stop['last_event']:.0f} s"
        print(f"{'8 ranks, 1 step/s, every rank hangs':<34} {hang:>8}")
        wrong = [
            b
            for _, b in receiver.alerts
            if b["state"] == "opened" and b["finding"]["kind"] not in ("stopped_reporting", "stalled")
        ]
        wrong_rank = [
            b
            for _, b in receiver.alerts
            if b["state"] == "opened"
            and b["finding"]["kind"] == "stopped_reporting"
            and b["finding"]["rank"] != next(j[3] for j in jobs if j[0] == b["run_id"]).get("rank")
        ]
        print(f"other alerts: {len(wrong)} of another kind, {len(wrong_rank)} on another rank")


def run_round(quick: bool) -> None:
    from infra.local import WATCH_INTERVAL_S, LocalStack, scheduled_event
    from infra.wiring import schedule_sources

    runs, ranks, keys, steps = (10 if quick else 50), 512, 4, (20 if quick else 40)
    # The stack's own schedule is put off (this runs the rounds itself, to time them); the watch is told
    # the default interval, which sets its summaries' budget.
    interval = {"WATCH_INTERVAL_S": f"{WATCH_INTERVAL_S:g}"}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalStack(port=0, data_dir=tmp, watch_interval=3600, environment=interval) as stack,
    ):
        stack.wait_ready()
        project = "bench-round"
        path = "/v1/projects/{p}/runs/r{run}/rank-metrics/batch"

        def batch(run: int, step: int) -> dict[str, Any]:
            now = time.time()
            return {
                "events": [
                    {
                        "event_id": f"{run}-{step}-{r}",
                        "step": step,
                        "rank": r,
                        "world_size": ranks,
                        "time": now,
                        "metrics": {f"k{k}": 1.0 + 0.01 * ((r + k + step) % 7) for k in range(keys)},
                    }
                    for r in range(ranks)
                ]
            }

        started = time.perf_counter()
        for step in range(steps):
            for run in range(runs):
                post(stack.url, stack.token, path.format(p=project, run=run), batch(run, step))
        print(
            f"\n## rounds over {runs} live runs of {ranks} ranks x {keys} keys ({runs * steps * ranks:,} "
            f"events loaded in {time.perf_counter() - started:.0f} s), a round every "
            f"{WATCH_INTERVAL_S:g} s as `instantml local` runs them, while every run goes on logging"
        )
        (source,) = schedule_sources()
        watch = stack._workers[source.function]
        in_round = threading.Event()
        stop = threading.Event()
        latencies: dict[bool, list[float]] = {False: [], True: []}

        def ingest() -> None:  # every run a step every 2 s (25 batches of 512 events a second at 50 runs)
            step = steps
            while not stop.is_set():
                began = time.time()
                for run in range(runs):
                    during = in_round.is_set()
                    latencies[during].append(
                        post(stack.url, stack.token, path.format(p=project, run=run), batch(run, step))
                    )
                step += 1
                time.sleep(max(0.0, began + 2.0 - time.time()))

        thread = threading.Thread(target=ingest, daemon=True)
        thread.start()
        time.sleep(20.0)  # ingest alone first
        rounds = []
        for _ in range(6):
            began = time.perf_counter()
            in_round.set()
            answer = watch.invoke(scheduled_event(source, time.time()))
            in_round.clear()
            rounds.append((time.perf_counter() - began, answer))
            time.sleep(max(0.0, WATCH_INTERVAL_S - (time.perf_counter() - began)))
        stop.set()
        thread.join()

        def p99(values: list[float]) -> float:
            return sorted(values)[max(0, int(len(values) * 0.99) - 1)] * 1000

        for i, (seconds, answer) in enumerate(rounds):
            print(
                f"round {i + 1}: {seconds:.1f} s, {answer['runs']} runs, {answer['summarized']} summarized, "
                f"{answer['failed']} failed"
            )
        alone, during = latencies[False], latencies[True]
        print(
            f"ingest of a {ranks}-event batch: p99 {p99(alone):.0f} ms outside rounds ({len(alone)} "
            f"batches), {p99(during):.0f} ms during rounds ({len(during)} batches): "
            f"{p99(during) / p99(alone):.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer jobs and runs (a few minutes)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the quality replay")
    parser.add_argument("--only", default="quality,latency,round")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "quality" in parts:
        run_quality(args.quick, args.jobs)
    if "latency" in parts:
        run_latency(args.quick)
    if "round" in parts:
        run_round(args.quick)


if __name__ == "__main__":
    main()
