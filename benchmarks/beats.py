"""What liveness costs at 512 ranks (contract 8): the monitor threads' beats and CPU, and what a beat
costs the store, side by side with a job that logs.

    .venv/bin/python -m benchmarks.beats [--ranks 512] [--seconds 10]

1. **Client**: ``--ranks`` real monitor threads (``instantml.monitor.thread.Monitor``, the class every
   process of a job runs) in one process, each watching a process whose main thread logs a step every
   0.1 s (healthy), then one whose main thread stops (every rank hung). The beats they would send
   are counted and timed (a sink in place of the uploader); the hung phase runs at a 1 s beat interval
   and is scaled to the default 30 s by the median time between a process's beats, in intervals. CPU is
   the process's, less a run of the same loggers without monitors: per monitor, as a share of a core.
2. **Store**: that many beats through the real ``UpdateRunFunction`` handler (``PATCH`` of the run, with
   a real API Gateway v2 event) on moto, every DynamoDB call metered (``benchmarks/metering.py``): write
   and read units per beat, and the busiest item.

The floor beside it: a job that logs sends its events anyway; beats add nothing while it does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instantml import limits, settings


class Sink:
    """Where a monitor's beats would go: counted."""

    def __init__(self) -> None:
        self.beats = 0
        self.at: dict[int, list[float]] = {}  # per rank, when each beat came
        self.lock = threading.Lock()

    def update_run(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.beats += 1
            self.at.setdefault(body["process"]["rank"], []).append(time.monotonic())

    def gaps(self) -> list[float]:
        """The seconds between a process's consecutive beats, every process's."""
        return [b - a for times in self.at.values() for a, b in itertools.pairwise(times)]


class Process:
    """What a monitor reads of a process (``instantml.monitor.thread.Watched``)."""

    def __init__(self, rank: int, world: int, sink: Sink) -> None:
        self.step: int | None = 0
        self.who: dict[str, Any] | None = {
            "rank": rank,
            "world_size": world,
            "pid": 1000 + rank,
            "attempt": 0,
        }
        self.ended = False
        self.thread_failure: dict[str, Any] | None = None
        self.sink = sink


def _phase(ranks: int, seconds: float, logging: bool, monitors: bool, beat_s: float) -> tuple[Sink, float]:
    """The beats (their sink) and the CPU seconds of ``ranks`` processes for ``seconds``."""
    from instantml.monitor.thread import Monitor

    os.environ[settings.BEAT_ENV] = str(beat_s)
    sink = Sink()
    processes = [Process(r, ranks, sink) for r in range(ranks)]
    threads = [Monitor(p) for p in processes] if monitors else []
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if logging:
            for p in processes:
                p.step = (p.step or 0) + 1  # what log_rank_metrics stores for the monitor
        time.sleep(0.1)
    cpu = time.process_time() - cpu0
    for t in threads:
        t.stop()
    for t in threads:
        t.join(5)
    return sink, cpu


def client(ranks: int, seconds: float) -> dict[str, float]:
    default = settings.DEFAULT_BEAT_S
    healthy, healthy_cpu = _phase(ranks, seconds, logging=True, monitors=True, beat_s=default)
    _, floor_cpu = _phase(ranks, seconds, logging=True, monitors=False, beat_s=default)
    fast = 1.0
    hung, _ = _phase(ranks, seconds, logging=False, monitors=True, beat_s=fast)
    gap = statistics.median(hung.gaps())  # one beat per interval while silent: about ``fast``
    return {
        "healthy_beats": healthy.beats,
        "healthy_rps": healthy.beats / seconds,
        "monitor_cpu_share": max(0.0, healthy_cpu - floor_cpu) / seconds / ranks,
        "hung_gap_intervals": gap / fast,
        "hung_silent_ranks": len(hung.at),
        "hung_rps_default": len(hung.at) / (gap / fast * default),
    }


def store(ranks: int) -> dict[str, Any]:
    from benchmarks.aws_model import PROJECT, Function, _http_event, _memory, metered_deployment
    from infra import template

    functions = template.functions()
    route = next(
        name
        for name, f in functions.items()
        if any(e.get("Properties", {}).get("Method") == "PATCH" for e in (f.get("Events") or {}).values())
    )
    with metered_deployment() as (_, meter):
        path = f"/v1/projects/{PROJECT}/runs/beats"
        authorizer = Function(
            "AuthorizerFunction",
            functions["AuthorizerFunction"]["Handler"],
            _memory(functions["AuthorizerFunction"]),
            meter,
        )
        verdict = authorizer({**_http_event("PATCH", path, None), "type": "REQUEST"}).answer["context"]
        handler = Function(route, functions[route]["Handler"], _memory(functions[route]), meter)
        now = time.time()

        def send(body: dict[str, Any]) -> Any:
            event = _http_event("PATCH", path, json.dumps(body))
            event["requestContext"]["authorizer"] = {"lambda": verdict}
            return handler(event)

        who = [{"rank": r, "world_size": ranks, "pid": 1000 + r, "attempt": 0} for r in range(ranks)]
        for w in who:  # each process's start, not counted
            assert (
                send({"process": {**w, "state": "started", "first_step": 0}, "time": now - 60}).answer[
                    "statusCode"
                ]
                == 200
            )
        stack = [f"train.py:{40 + i} frame_{i}" for i in range(12)]
        calls = []
        for w in who:
            body = {
                "process": {
                    **w,
                    "state": "beat",
                    "step": 100,
                    "silent_s": 40.0,
                    "every": 30.0,
                    "stack": stack,
                },
                "time": now,
            }
            call = send(body)
            assert call.answer["statusCode"] == 200, call.answer
            calls.append(call)
        wcu = [c.bill.total_wcu for c in calls]
        rcu = [c.bill.total_rcu for c in calls]
        items: dict[Any, int] = {}
        for c in calls:
            for item, units in c.bill.item_wcu.items():
                items[item] = items.get(item, 0) + units
    return {
        "route": route,
        "wcu_per_beat": statistics.mean(wcu),
        "rcu_per_beat": statistics.mean(rcu),
        "items_written": len(items),
        "busiest_item_wcu": max(items.values()),
        "writes_per_beat": statistics.mean(
            sum(n for op, n in c.bill.calls.items() if op in ("PutItem", "UpdateItem", "DeleteItem"))
            for c in calls
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    started = time.monotonic()
    c = client(args.ranks, args.seconds)
    s = store(args.ranks)
    every = settings.DEFAULT_BEAT_S
    print(f"liveness at {args.ranks} ranks (default beat every {every:g} s; `benchmarks/beats.py`)\n")
    print(f"{'figure':<58} {'measured':>14}  goal")
    print("-" * 90)
    print(f"{'extra requests/s, a healthy job (every rank logs)':<58} {c['healthy_rps']:>14.2f}  ~0")
    floor = args.ranks / limits.UPLOAD_LINGER_S  # one batch per rank per linger, whatever its pace
    print(
        f"{'  beside it, its events own requests/s (derived)':<58} {floor:>14.1f}"
        f"  a batch per rank per UPLOAD_LINGER_S ({limits.UPLOAD_LINGER_S:g} s)"
    )
    print(f"{'extra requests/s, every rank hung':<58} {c['hung_rps_default']:>14.1f}  <= 20")
    print(
        f"{'seconds between a hung process beats, in beat intervals':<58} {c['hung_gap_intervals']:>14.2f}  "
        f">= 1 (<= 1 beat per {every:g} s); {c['hung_silent_ranks']:.0f} ranks beat"
    )
    print(f"{'store writes per beat (' + s['route'] + ')':<58} {s['writes_per_beat']:>14.2f}  <= 1")
    print(f"{'write units per beat (DynamoDB, metered on moto)':<58} {s['wcu_per_beat']:>14.2f}")
    print(f"{'read units per beat':<58} {s['rcu_per_beat']:>14.2f}")
    print(
        f"{'items written by the beats / most units on one item':<58} "
        f"{s['items_written']:>7} / {s['busiest_item_wcu']:<5}  one per process, no hot item"
    )
    print(
        f"{'monitor thread CPU, share of a core per process':<58} {c['monitor_cpu_share'] * 100:>13.4f}%  "
        "< 0.1%"
    )
    print(f"\n{time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
