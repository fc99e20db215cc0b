"""Issue 26's model: one 512-rank job on AWS, computed from the real handlers on moto, every call metered.

    .venv/bin/python -m benchmarks.aws_model [--ranks 512] [--keys 4] [--rates 1 5] [--steps 100000]
                                             [--sample-events 6000]

(about 10 minutes here, 2 shared cores.) Every input is printed.

What is driven, each through its real Lambda handler with API Gateway's or the stream's events, on moto
with the template's tables, every boto3 call metered by ``benchmarks.metering`` (DynamoDB's billing
rules: write units on the larger of the item before and after, failed conditions included, index
writes; read units on the whole items read):

1. **Ingest**, for each step rate: the job's uploads as the client sends them (``instantml.limits``:
   each rank's uploader sends once per ``UPLOAD_LINGER_S``, or once ``batch_size`` events wait, its
   phase random), for ``--sample-events`` events of a steady stretch of the job, through ``K`` ingest
   instances (separate imports of the function: their own store, memory of noted runs and clients),
   ``K`` being the concurrency the request rate and the measured duration need. The authorizer is called
   as API Gateway calls it with its verdict cache (once per token per ``AuthorizerCacheSeconds``).
2. **Rollups**: how many times each block is rolled up comes from the stream's batches (the template's
   ``BatchSize`` and ``MaximumBatchingWindowInSeconds``) over the job's arrival times; at each rate,
   the roll of one stream batch's new steps (and the blocks above them) is measured through the rollup
   handler, fed the stream record of the step ``SETTLE_STEPS`` after them, at ``--ranks`` ranks.
3. **Summaries**, through the summarize handler as it is on this branch, at ``--ranks`` ranks: the worst
   read in raw mode (no rollups at all: the store's ``raw_read_budget`` events read one by one, the
   rest said to be missing), and a live run at ``--steps`` (rolled blocks written through the store's
   ``write_blocks``, as the rollup function leaves them, and the newest steps beyond the rollups' mark
   read event by event) summarized by a fresh function instance, then refreshed on that instance after
   the run moved on by one refresh of the tab (its blocks' sums kept by the store: ``SumsCache``).
4. **Cold start**: each function's imports in a fresh interpreter, as CPU seconds (what the machine's
   load does not inflate) scaled to the function's share of a vCPU, and wall seconds here; the
   deployed code root's size.
5. **The first minute of the job** (``benchmarks/job_start.py``): every rank's first upload, onto cold
   ingest and authorizer instances within the template's reserved concurrency, with the client's
   spread of first uploads (``limits.FIRST_UPLOADS_PER_S``) and without it: requests throttled, and
   uploads still held for a retry at the minute's end. ``--start-only`` prints only this (a short
   ingest sample gives the durations).

Lambda's duration is modelled as the handler's CPU time here (moto's own work and the meter's taken
out) scaled to the function's memory (a vCPU at 1,769 MB), plus ``LATENCY_S`` per DynamoDB round trip
on the request's path (puts 16 at a time). Prices: us-east-1 on-demand list prices (below).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import gzip
import importlib.util
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.metering import Bill, Meter, Table, moto_item_reader

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "distributed-job"
#: Steps of the rollup blocks the model rolls and copies (a level of ``shared.rollups.LEVELS``).
BLOCK = 100
TOKEN = "model-token"
KEY_NAMES = ("train/loss", "train/grad_norm", "train/lr", "data/seconds", "train/tokens", "train/acc")

# Prices, us-east-1 on-demand list prices (shared/engineering: benchmarks.md's inputs).
WRITE_UNIT_USD = 0.625e-6
READ_UNIT_USD = 0.125e-6
API_REQUEST_USD = 1.00e-6  # HTTP API, first 300 million a month
LAMBDA_REQUEST_USD = 0.20e-6
LAMBDA_GB_SECOND_USD = 0.0000166667  # x86
LOG_GB_USD = 0.50  # CloudWatch Logs ingestion
STORAGE_GB_MONTH_USD = 0.25  # DynamoDB standard table class
PITR_GB_MONTH_USD = 0.20  # DynamoDB continuous backups (point-in-time recovery), per GB of the table
ALARM_MONTH_USD = 0.10  # a CloudWatch standard-resolution alarm
METRIC_MONTH_USD = 0.30  # a CloudWatch custom metric (each name and dimension value)
#: The ingest function's metrics per route (``functions/ingest/app.py``'s ``emit_metrics``).
INGEST_METRIC_NAMES = 4
STREAM_READ_USD = 0.0  # GetRecords of a Lambda trigger are free (DynamoDB pricing: "DynamoDB Streams")
#: Round trip of one DynamoDB call from Lambda in the same region (a few ms; assumed, not measured here).
LATENCY_S = 0.006
#: Lambda's CPU: one full vCPU at 1,769 MB, proportionally less below.
FULL_VCPU_MB = 1769
#: What Lambda itself writes to a function's log per invocation (START, END, REPORT lines), and the
#: HTTP API's access log line of the template's format with typical values: bytes.
PLATFORM_LOG_BYTES = 330
ITEM_OVERHEAD_BYTES = 100  # DynamoDB's per-item storage overhead
PARTITION_WRITE_UNITS = 1000  # a partition's limit per second
PARTITION_READ_UNITS = 3000
#: Live runs of one project at once, the team the model's keys figure is for (issue 41).
TEAM_RUNS = 100
#: DynamoDB's default quota of an on-demand table's write units per second (raised on request).
TABLE_WRITE_QUOTA = 40_000
TAB_REFRESH_S = 5.0  # the Distributed tab's refresh of a live run


@dataclass
class Job:
    ranks: int
    keys: int
    rate: float  # steps per second
    linger: float  # the uploaders' time bound
    batch: int  # the uploaders' size bound (events)

    @property
    def interval(self) -> float:
        """Seconds between two requests of one rank's uploader."""
        return min(self.linger, self.batch / self.rate)

    @property
    def requests_per_s(self) -> float:
        return self.ranks / self.interval

    @property
    def events_per_s(self) -> float:
        return self.ranks * self.rate


@dataclass
class Upload:
    at: float  # simulated seconds since the job started
    rank: int
    steps: list[int]


def uploads(job: Job, start: float, seconds: float, seed: int = 26) -> list[Upload]:
    """Each rank's requests in ``[start, start + seconds)``: a rank logs step ``s`` at ``s / rate`` and
    its uploader sends every ``interval`` seconds (its phase random) what was logged since its last send."""
    rng = random.Random(seed)
    out = []
    for rank in range(job.ranks):
        phase = rng.uniform(0, job.interval)
        k = max(1, math.ceil((start - phase) / job.interval))
        while (at := phase + k * job.interval) < start + seconds:
            first = math.floor((at - job.interval) * job.rate) + 1
            last = math.floor(at * job.rate)
            steps = list(range(max(0, first), last + 1))
            if steps:
                out.append(Upload(at, rank, steps))
            k += 1
    return sorted(out, key=lambda u: u.at)


# --- the functions, as Lambda runs them -----------------------------------------------------------


class Context:
    def __init__(self, name: str, memory: int) -> None:
        self.function_name = name
        self.memory_limit_in_mb = memory
        self.invoked_function_arn = f"arn:aws:lambda:us-east-1:000000000000:function:{name}"
        self.aws_request_id = "model"

    def get_remaining_time_in_millis(self) -> int:
        # An hour: moto and the meter make a call here many times slower than on AWS, and what the
        # model measures is CPU, not whether a deadline that wall clock inflates is met.
        return 3_600_000


@dataclass
class Invocation:
    cpu_s: float = 0.0
    log_bytes: int = 0
    bill: Bill = field(default_factory=Bill)
    answer: Any = None

    def duration_s(self, memory: int) -> float:
        """CPU scaled to the memory's share of a vCPU, plus a round trip per sequential DynamoDB call
        (the puts of a batch go 16 at a time)."""
        puts = self.bill.calls.get("PutItem", 0)
        others = sum(self.bill.calls.values()) - puts
        return self.cpu_s * max(1.0, FULL_VCPU_MB / memory) + (math.ceil(puts / 16) + others) * LATENCY_S


class Function:
    """One instance of a function: its module imported anew (a cold start), called as Lambda calls it."""

    def __init__(self, name: str, handler: str, memory: int, meter: Meter, instance: int = 0) -> None:
        module_name, _, attr = handler.rpartition(".")
        path = ROOT / (module_name.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(f"{module_name}__model{instance}", path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.handler = getattr(module, attr)
        self.name, self.memory, self.meter = name, memory, meter

    def __call__(self, event: dict[str, Any]) -> Invocation:
        self.meter.take()
        excluded = self.meter.excluded_cpu
        out = io.StringIO()
        started = time.process_time()
        with contextlib.redirect_stdout(out), _logs_to(out):
            answer = self.handler(event, Context(self.name, self.memory))
        cpu = time.process_time() - started - (self.meter.excluded_cpu - excluded)
        return Invocation(max(0.0, cpu), len(out.getvalue().encode()), self.meter.take(), answer)


@contextlib.contextmanager
def _logs_to(stream: io.StringIO) -> Any:
    """What the functions log (Powertools' handlers hold the stdout they were made with) goes to
    ``stream``: CloudWatch bills its bytes."""
    import logging

    handlers = [
        h
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        if isinstance(logger, logging.Logger)
        for h in logger.handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stdout__, sys.stdout, sys.__stderr__)
    ]
    saved = [h.setStream(stream) for h in handlers]
    try:
        yield
    finally:
        for h, old in zip(handlers, saved, strict=True):
            h.setStream(old)


def _http_event(
    method: str, path: str, body: str | None, query: dict[str, str] | None = None
) -> dict[str, Any]:
    event = json.loads((ROOT / "events" / "post_rank_metrics_batch.json").read_text())
    event["routeKey"] = event["requestContext"]["routeKey"] = f"{method} {path}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    parts = path.split("/")
    event["pathParameters"] = {"project": parts[3], "run_id": parts[5]}
    event["body"] = body
    event["rawQueryString"] = "&".join(f"{k}={v}" for k, v in (query or {}).items())
    event["queryStringParameters"] = query or None
    event["headers"]["authorization"] = f"Bearer {TOKEN}"
    event["headers"]["accept-encoding"] = "gzip, deflate, br"
    return event  # type: ignore[no-any-return]


def batch_body(job: Job, upload: Upload, t0: float, rng: random.Random) -> str:
    keys = KEY_NAMES[: job.keys]
    events = []
    for step in upload.steps:
        events.append(
            {
                "event_id": "%032x" % rng.getrandbits(128),  # noqa: UP031
                "step": step,
                "rank": upload.rank,
                "world_size": job.ranks,
                "local_rank": upload.rank % 8,
                "weight": 1.0,
                "metrics": {k: round(rng.uniform(0, 10), 6) for k in keys},
                "time": t0 + step / job.rate + rng.uniform(0, 0.05),
            }
        )
    return json.dumps({"events": events})


# --- the model ------------------------------------------------------------------------------------


@dataclass
class IngestSample:
    job: Job
    seconds: float
    requests: int
    events: int
    instances: int
    bill: Bill
    ingest: list[Invocation]  # the first on a cold instance
    authorizer: Invocation  # a verdict on a warm instance
    first_authorizer: Invocation  # the instance's first verdict
    statuses: Counter[int]


def run_ingest(
    job: Job,
    meter: Meter,
    refs: dict[str, str],
    sample_events: int,
    run_id: str,
    instances_of_team: int | None = None,
) -> IngestSample:
    """The job's requests over ``sample_events`` events of a steady stretch, through the real authorizer's
    verdict and ingest handler on as many instances as the job keeps busy; or, with
    ``instances_of_team``, each request on one of that many instances drawn at random (created when
    first drawn): a team's runs share the instances, so one run's requests rarely meet an instance that
    has seen that run in the last second."""
    from infra import template

    functions = template.functions()
    memory = _memory(functions["IngestFunction"])
    seconds = sample_events / job.events_per_s
    # A steady stretch: a few intervals in, so that every rank's uploader has sent before.
    start = 3 * job.interval + 0.5
    plan = uploads(job, start, seconds)
    rng = random.Random(7)
    t0 = time.time() - 10 * 86400  # event times in the past: never capped by the server's clock
    path = f"/v1/projects/{PROJECT}/runs/{run_id}/rank-metrics/batch"
    authorizer = Function(
        "AuthorizerFunction",
        functions["AuthorizerFunction"]["Handler"],
        _memory(functions["AuthorizerFunction"]),
        meter,
    )
    first_verdict = authorizer({**_http_event("POST", path, None), "type": "REQUEST"})  # cold
    verdict_call = authorizer({**_http_event("POST", path, None), "type": "REQUEST"})
    verdict = verdict_call.answer["context"]
    handler = functions["IngestFunction"]["Handler"]
    instances = [Function("IngestFunction", handler, memory, meter, 0)]
    calls: list[Invocation] = []
    statuses: Counter[int] = Counter()
    total = Bill()

    def send(upload: Upload, function: Function) -> None:
        event = _http_event("POST", path, batch_body(job, upload, t0, rng))
        event["requestContext"]["authorizer"] = {"lambda": verdict}
        call = function(event)
        statuses[call.answer["statusCode"]] += 1
        calls.append(call)
        total.add(call.bill)

    if instances_of_team is not None:
        drawn: dict[int, Function] = {}
        for upload in plan:
            i = rng.randrange(instances_of_team)
            if i not in drawn:
                drawn[i] = Function("IngestFunction", handler, memory, meter, 1000 + i)
            send(upload, drawn[i])
        events = sum(len(u.steps) for u in plan)
        return IngestSample(
            job, seconds, len(plan), events, len(drawn), total, calls, verdict_call, first_verdict, statuses
        )
    calibration = plan[:8]
    for upload in calibration:  # a first estimate of the duration: how many instances are busy at once
        send(upload, instances[0])
    mean = statistics.mean(c.duration_s(memory) for c in calls[1:])  # the first one was cold
    k = max(1, math.ceil(job.requests_per_s * mean * 1.5))
    instances += [Function("IngestFunction", handler, memory, meter, i) for i in range(1, k)]
    for n, upload in enumerate(plan[len(calibration) :]):
        send(upload, instances[n % k])
    events = sum(len(u.steps) for u in plan)
    return IngestSample(
        job, seconds, len(plan), events, k, total, calls, verdict_call, first_verdict, statuses
    )


def _memory(function: dict[str, Any]) -> int:
    return int(function["MemorySize"])


def rolls_per_block(job: Job, blocks: int = 6) -> tuple[float, float]:
    """How many times each step is rolled up (so each batch's worth of rolling, as measured below),
    and the stream's batches per second, from the arrival times of the job's events and the template's
    stream settings (one stream shard: the worst case for re-rolls). ``shared.summary.rolling.roll_up``'s
    rule: the steps up to ``SETTLE_STEPS`` behind the newest one a batch names are rolled once; a step named
    again after that, with new events, is rolled again."""
    from infra import template
    from shared.summary.rolling import SETTLE_STEPS

    mapping = template.functions()["RollupFunction"]["Events"]["MetricsStream"]["Properties"]
    batch_size, window = int(mapping["BatchSize"]), float(mapping["MaximumBatchingWindowInSeconds"])
    span = blocks * BLOCK / job.rate
    start = 2 * BLOCK / job.rate
    arrivals = sorted((u.at, step) for u in uploads(job, start, span + 3 * job.interval) for step in u.steps)
    batches: list[list[int]] = []
    opened: float | None = None
    current: list[int] = []
    for at, step in arrivals:
        if opened is None:
            opened = at
        if at - opened > window or len(current) >= batch_size:
            batches.append(current)
            opened, current = at, []
        current.append(step)
    batches.append(current)
    mark, rolls = -1, Counter[int]()
    for batch in batches:
        touched = set(batch)
        target = max(mark, max(touched) - SETTLE_STEPS)
        for step in touched:
            if step <= mark:
                rolls[step] += 1
        for step in range(mark + 1, target + 1):
            rolls[step] += 1
        mark = target
    first, last = int(start * job.rate) + BLOCK, int((start + span) * job.rate) - BLOCK
    measured = [rolls[step] for step in range(first, last + 1)]
    seconds = arrivals[-1][0] - arrivals[0][0]
    return statistics.mean(measured), len(batches) / seconds


@dataclass
class Measured:
    """A handler call at the job's size and its figures."""

    name: str
    call: Invocation
    items: int = 0
    rcu: float = 0.0
    body_bytes: int = 0
    notes: str = ""


def write_events(store: Any, run_id: str, ranks: int, keys: int, steps: range, t0: float) -> int:
    """The items the ingest function puts, written 25 a call (the set-up, not billed)."""
    from benchmarks.watch_dynamodb import write_raw
    from shared.events import RankEvent

    rng = random.Random(3)
    names = KEY_NAMES[:keys]
    events = [
        RankEvent(
            PROJECT,
            run_id,
            f"{step:x}-{rank:x}-{rng.getrandbits(64):016x}",
            step,
            rank,
            ranks,
            rank % 8,
            1.0,
            t0 + step,
            names,
            tuple(rng.uniform(0, 10) for _ in names),
            b"\0" * 16,
        )
        for step in steps
        for rank in range(ranks)
    ]
    write_raw(store, events)
    return len(events)


def stream_event(run_id: str, step: int, refs: dict[str, str]) -> dict[str, Any]:
    event = json.loads((ROOT / "events" / "rollup_stream.json").read_text())
    record = copy.deepcopy(event["Records"][0])
    record["dynamodb"]["Keys"] = {"pk": {"S": f"{PROJECT}#{run_id}#00"}, "sk": {"S": f"{step:016d}#x"}}
    return {"Records": [record]}


def run_rollup_and_summaries(
    meter: Meter,
    refs: dict[str, str],
    ranks: int,
    keys: int,
    steps: int,
    batch_steps: list[int],
    tail: int,
    refresh: int,
) -> dict[str, Measured]:
    """The rollup and the summaries at the job's size: a roll of each of ``batch_steps`` (the new steps a
    stream batch brings at each rate); ``tail`` steps of a live run beyond the rollups' mark (read event
    by event), the tab refreshed after ``refresh`` more steps on the same warm function instance."""
    from infra import template
    from shared import rollups
    from shared.store.dynamodb import DynamoStore

    functions = template.functions()
    store = DynamoStore(refs["MetricsTable"], runs_table=refs["RunsTable"])
    t0 = time.time() - 10 * 86400
    out: dict[str, Measured] = {}

    # One roll: a stream batch's new steps rolled up at level 1 (and the blocks above them), as a batch
    # naming the step SETTLE_STEPS after them makes due.
    from shared.summary.rolling import SETTLE_STEPS

    rollup = Function(
        "RollupFunction", functions["RollupFunction"]["Handler"], _memory(functions["RollupFunction"]), meter
    )
    for n in sorted(set(batch_steps)):
        newest = n - 1 + SETTLE_STEPS
        write_events(store, f"rolled-{n}", ranks, keys, range(0, newest + 1), t0)
        meter.take()
        roll = rollup(stream_event(f"rolled-{n}", newest, refs))
        out[f"roll {n}"] = Measured(f"{n} steps rolled up (a stream batch's)", roll)
    idle = rollup(stream_event(f"rolled-{n}", newest, refs))  # a batch with nothing due
    out["idle roll"] = Measured("a stream batch with nothing due", idle)

    summarize = Function(
        "SummarizeFunction",
        functions["SummarizeFunction"]["Handler"],
        _memory(functions["SummarizeFunction"]),
        meter,
    )

    def summary(run_id: str, function: Function = summarize) -> Invocation:
        call = function(_http_event("GET", f"/v1/projects/{PROJECT}/runs/{run_id}/distributed", None))
        assert call.answer["statusCode"] == 200, call.answer
        return call

    def resolution(call: Invocation) -> dict[str, Any]:
        body = call.answer["body"]
        text = gzip.decompress(base64.b64decode(body)) if call.answer.get("isBase64Encoded") else body
        return json.loads(text)["resolution"]  # type: ignore[no-any-return]

    # Raw mode: no rollups at all (lagging far behind), more events than a summary reads one by one:
    # it reads the store's raw_read_budget of them and says through which step it is complete.
    from shared.summary.reads import raw_read_budget

    budget = raw_read_budget(store)
    write_events(store, "raw", ranks, keys, range(0, budget // ranks + 10), t0)
    meter.take()
    raw = summary("raw")
    said = resolution(raw)
    out["raw"] = Measured(
        f"raw mode, {ranks} ranks x {budget // ranks + 10} steps, no rollups",
        raw,
        notes=f"reads at most {budget:,} events (raw_read_budget); answered {said}",
    )

    # A live run at ``steps``: its blocks rolled up (copies of a real rollup, written through the
    # store as the rollup function writes them) and the newest ``tail`` steps read event by event.
    import numpy as np

    from shared.summary.decoding import decode, units_from_run

    page = store.read_events(PROJECT, f"rolled-{n}", 0, n - 1)
    run = decode(page.events)
    unique = np.unique(run.event_step)
    units = units_from_run(run, unique, np.arange(len(unique)), len(unique), ranks)
    counts = np.bincount(np.searchsorted(unique, run.event_step))
    rolled = rollups.roll_steps(units, counts)
    level1 = []  # every rank at every step: a block's header is its fixed 40 bytes
    for i in range(BLOCK):
        model = rolled[i % len(rolled)]
        level1.append(replace(model, header=replace(model.header, block=i, first_step=i, last_step=i)))
    per_level = {1: level1[0], 10: rollups.combine(10, 0, level1[:10]), 100: rollups.combine(100, 0, level1)}

    def copy_of(size: int, block: int) -> rollups.RolledBlock:
        first = block * size
        model = per_level[size]
        header = replace(model.header, block=block, first_step=first, last_step=first + size - 1)
        return replace(model, header=header)

    def rolled_through(mark: int) -> set[tuple[int, int]]:
        """The blocks a summary of steps 0..mark at level 100 reads: whole blocks of 100, 10 and 1,
        coarsest first (the levels of 1,000 and 10,000 above them are not read: left out)."""
        blocks: set[tuple[int, int]] = set()
        low = 0
        for size in (100, 10, 1):
            whole = (mark + 1 - low) // size
            blocks |= {(size, low // size + i) for i in range(whole)}
            low += whole * size
        return blocks

    def advance(run_id: str, mark: int, had: set[tuple[int, int]], new_steps: range) -> set[tuple[int, int]]:
        now = rolled_through(mark)
        fresh = [copy_of(size, b) for size, b in sorted(now - had)]
        for i in range(0, len(fresh), 200):
            store.write_blocks(PROJECT, run_id, fresh[i : i + 200])
        store.advance_rollups(PROJECT, run_id, mark, b"")
        write_events(store, run_id, ranks, keys, new_steps, t0)
        return now

    mark = steps - 1 - tail
    write_events(store, "long", ranks, keys, range(0, 1), t0)  # a run's first step is found among its events
    blocks = advance("long", mark, set(), range(mark + 1, steps))
    meter.take()
    first_instance = Function(
        "SummarizeFunction",
        functions["SummarizeFunction"]["Handler"],
        _memory(functions["SummarizeFunction"]),
        meter,
        instance=1,
    )
    long = summary("long", first_instance)
    out["long"] = Measured(
        f"live run at step {steps:,}, first summary of a function instance",
        long,
        notes=f"{len(blocks):,} rolled blocks there, {tail} steps beyond the mark; {resolution(long)}",
    )
    advance("long", mark + refresh, blocks, range(steps, steps + refresh))
    meter.take()
    again = summary("long", first_instance)
    out["refresh"] = Measured(
        f"the same tab {refresh} steps later, the same warm instance",
        again,
        notes=f"{resolution(again)}",
    )
    for m in out.values():
        m.items = sum(m.call.bill.items_read.values())
        m.rcu = m.call.bill.total_rcu
        body = m.call.answer.get("body", "") if isinstance(m.call.answer, dict) else ""
        m.body_bytes = len(body)
    return out


@dataclass
class ColdStart:
    cpu_s: float  # CPU seconds of the import here (median of 3): what a loaded machine does not inflate
    wall_s: float  # wall seconds here (median of 3): inflated by the machine's load
    memory: int

    @property
    def at_memory_s(self) -> float:
        """The import's CPU at the function's share of a vCPU (as the handlers' durations are scaled)."""
        return self.cpu_s * max(1.0, FULL_VCPU_MB / self.memory)


def cold_starts() -> dict[str, ColdStart]:
    """Each function's handler module imported in a fresh interpreter (median of 3)."""
    from infra import template

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = {}
    for name, function in template.functions().items():
        module = function["Handler"].rpartition(".")[0]
        code = (
            "import time; c, t = time.process_time(), time.perf_counter(); "
            f"import {module}; print(time.process_time() - c, time.perf_counter() - t)"
        )
        cpu, wall = [], []
        for _ in range(3):
            answer = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
            )
            ok = answer.returncode == 0
            last = answer.stdout.strip().splitlines()[-1].split() if ok else ["nan", "nan"]
            cpu.append(float(last[0]))
            wall.append(float(last[1]))
        out[name] = ColdStart(statistics.median(cpu), statistics.median(wall), _memory(function))
    return out


def code_root() -> tuple[str, int, int]:
    """The deployed code root (the template's CodeUri) as ``sam build`` copies it (links followed,
    compiled files left out): its files and bytes."""
    from infra import template

    uri = str(template.load()["Globals"]["Function"].get("CodeUri", "."))
    files = [
        Path(folder) / name
        for folder, dirs, names in os.walk(ROOT / uri, followlinks=True)
        if "__pycache__" not in Path(folder).parts
        and not {".git", ".venv", ".cache"} & set(Path(folder).parts)
        for name in names
        if not name.endswith(".pyc")
    ]
    return uri, len(files), sum(f.stat().st_size for f in files)


#: Lambda's own start of a new Python instance before the handler's imports (the runtime and the code
#: fetched): assumed, not measured here (AWS's figures for Python are 100-300 ms).
RUNTIME_INIT_S = 0.25


def reserved_concurrency(function: dict[str, Any]) -> int | None:
    """The function's reserved concurrency in the template (``!If [Reserve, N, NoValue]``), or None."""
    value = function.get("ReservedConcurrentExecutions")
    if isinstance(value, dict) and "Fn::If" in value:
        value = value["Fn::If"][1]
    return int(value) if isinstance(value, int) else None


def job_start_rows(
    ranks: int, interval: float, starts: dict[str, ColdStart], sample: IngestSample, cache_s: float
) -> list[tuple[str, Any]]:
    """The first minute of a ``ranks``-rank job (``benchmarks.job_start``) at the template's
    concurrency, with the client's spread of first uploads and with others: (label, figures) rows, the
    client's first."""
    from benchmarks.job_start import Pool, first_minute
    from infra import template
    from instantml.upload import transport

    functions = template.functions()
    memory = {name: _memory(functions[name]) for name in ("IngestFunction", "AuthorizerFunction")}
    # warm: a request on an instance that has served before; cold: the runtime, the imports and what
    # the instance's first request costs beyond a warm one (its clients made, its first reads)
    ingest_warm = statistics.mean(c.duration_s(memory["IngestFunction"]) for c in sample.ingest[1:])
    timings = {
        "IngestFunction": (sample.ingest[0].duration_s(memory["IngestFunction"]), ingest_warm),
        "AuthorizerFunction": (
            sample.first_authorizer.duration_s(memory["AuthorizerFunction"]),
            sample.authorizer.duration_s(memory["AuthorizerFunction"]),
        ),
    }
    pools = {}
    for name, (first, warm) in timings.items():
        concurrency = reserved_concurrency(functions[name]) or 1000  # (unreserved: the account's)
        cold = RUNTIME_INIT_S + starts[name].at_memory_s + max(0.0, first - warm)
        pools[name] = Pool(concurrency, cold, warm)
    spread = transport.first_upload_spread_s("https://api.example.com", ranks)
    rows: list[tuple[str, Any]] = []
    for label, spread_s in [
        (f"with the client's spread of first uploads ({spread:.1f} s at {ranks} ranks)", spread),
        ("without it (every first upload as its process starts)", 0.0),
    ]:
        figures = first_minute(
            ranks, interval, pools["IngestFunction"], pools["AuthorizerFunction"], cache_s, spread_s=spread_s
        )
        rows.append((label, figures))
    return [*rows, ("pools", pools)]


def print_job_start(rows: list[tuple[str, Any]]) -> None:
    pools = dict(rows).pop("pools")
    ingest, authorizer = pools["IngestFunction"], pools["AuthorizerFunction"]
    print(
        f"\nthe first minute of the job (benchmarks/job_start.py: ingest {ingest.concurrency} instances at "
        f"most, cold {ingest.cold_s:.2f} s, warm {ingest.warm_s * 1e3:.1f} ms; authorizer "
        f"{authorizer.concurrency}, cold {authorizer.cold_s:.2f} s, warm {authorizer.warm_s * 1e3:.1f} ms; "
        f"a cold start: {RUNTIME_INIT_S:g} s of runtime, assumed, the imports and the first request's extra, "
        "measured):"
    )
    for label, f in rows:
        if label == "pools":
            continue
        print(
            f"  {label}: {f.attempts:,} requests, {f.throttled:,} throttled ({100 * f.throttled_share:.1f}%; "
            f"{f.throttled_authorizer} at the authorizer), {f.authorizer_calls} authorizer calls, "
            f"{f.ingest_instances} ingest instances; {f.delivered:,} of {f.uploads:,} uploads stored, "
            f"{f.held} still retried at the minute's end (held, not lost); every rank's first upload "
            f"stored by {f.last_first_upload_s:.1f} s"
        )


# --- a team: many live runs in one project --------------------------------------------------------


def team_run(n: int) -> str:
    return f"team-{n:03d}"


def team_key_loads(sample: IngestSample, runs: int) -> defaultdict[tuple[str, str], float]:
    """Write units/s on each partition key when ``runs`` live runs like the sample's (``team_run(0)``) log
    at once in one project: a key that names the run (its partitions of both tables) is its own, as
    measured; an index shard (``by_project``'s ``listing_shard``, ``by_received``'s ``watch_shard``) takes
    the sample's rate from each of the runs the store's own hash puts there; any other key is shared by
    all of them (the project's key of the earlier layout was one)."""
    from shared.store.dynamodb import listing_shard, watch_shard

    spread = {"by_project": listing_shard, "by_received": watch_shard}
    run = team_run(0)
    loads: defaultdict[tuple[str, str], float] = defaultdict(float)
    for (where, value), units in sample.bill.partition_wcu.items():
        rate = units / sample.seconds
        index = where.partition("/")[2]
        if run in str(value).split("#"):
            loads[(where, f"{value} (a run's own)")] = max(loads[(where, f"{value} (a run's own)")], rate)
        elif index in spread:
            assert spread[index](PROJECT, run) == value, (where, value)
            for n in range(runs):
                loads[(where, spread[index](PROJECT, team_run(n)))] += rate
        else:
            loads[(where, f"{value} (shared by all)")] += rate * runs
    return loads


def print_team(
    sample: IngestSample, loads: defaultdict[tuple[str, str], float], instances: int, job: Job
) -> None:
    by_where: dict[str, tuple[float, str]] = {}
    for (where, key), rate in loads.items():
        if rate > by_where.get(where, (-1.0, ""))[0]:
            by_where[where] = (rate, key)
    wcu = sample.bill.total_wcu / sample.events
    print(
        f"\n{TEAM_RUNS} live {job.ranks}-rank runs in one project at {job.rate:g} steps/s (one run's "
        f"{sample.requests:,} requests, each on one of {instances:,} ingest instances drawn at random, "
        f"{sample.instances} of them met: the instances {TEAM_RUNS} such jobs keep busy); busiest key of "
        f"each table and index, write units/s:"
    )
    for where, (rate, key) in sorted(by_where.items()):
        print(f"  {where:24} {rate:8.1f}  {key}")
    print(
        f"  such a team also needs the stage's ThrottleRateLimit at {TEAM_RUNS * job.requests_per_s:,.0f} "
        f"requests/s (250 by default), ingest's concurrency at about {instances:,} (ReserveConcurrency "
        f"false, or a raised account limit) and MaxWriteUnitsPerSecond at about "
        f"{TEAM_RUNS * job.events_per_s * wcu:,.0f} (10,000 by default; DynamoDB's quota is "
        f"{TABLE_WRITE_QUOTA:,} a table unless raised)"
    )


# --- the figures ----------------------------------------------------------------------------------


def day_bill(rate: dict[str, Any], refresh: Measured, memory: dict[str, int]) -> dict[str, float]:
    """A 24-hour job at ``rate``'s steps/s with the Distributed tab open all day, in USD, line by line:
    what every event costs (the table above), the tab's refreshes, the watch's rounds, the template's
    alarms and the ingest's metrics for a day, and a month of the events' storage and point-in-time
    recovery. The watch's round over the run is modelled as one warm refresh of its summary (what a
    round does for a live run) and is not measured through the watch's handler."""
    from infra import template

    job = rate["job"]
    events = job.events_per_s * 86400
    gb = events * rate["stored"] / 1e9
    functions = template.functions()
    alarms = sum(r["Type"] == "AWS::CloudWatch::Alarm" for r in template.load()["Resources"].values())
    routes = sum(e.get("Type") == "HttpApi" for e in functions["IngestFunction"].get("Events", {}).values())
    log_usd = (refresh.call.log_bytes + PLATFORM_LOG_BYTES) / 1e9 * LOG_GB_USD

    def summary_usd(function: str) -> float:
        seconds = refresh.call.duration_s(memory[function])
        return (
            LAMBDA_REQUEST_USD
            + seconds * memory[function] / 1024 * LAMBDA_GB_SECOND_USD
            + refresh.rcu * READ_UNIT_USD
            + log_usd
        )

    refreshes, rounds = 86400 / TAB_REFRESH_S, 24 * 60
    metrics = INGEST_METRIC_NAMES * routes
    return {
        "every event: writes, API, ingest, authorizer, rollups, logs (the table above)": rate["total"]
        * events
        / 1e6,
        f"summarize: the tab's {refreshes:,.0f} refreshes (every {TAB_REFRESH_S:g} s)": refreshes
        * (API_REQUEST_USD + summary_usd("SummarizeFunction")),
        f"watch: {rounds:,} rounds, each modelled as a warm refresh of the run's summary": rounds
        * summary_usd("WatchFunction"),
        f"CloudWatch: {alarms} alarms and {metrics} custom metrics, a day of their month": (
            alarms * ALARM_MONTH_USD + metrics * METRIC_MONTH_USD
        )
        / 30,
        f"DynamoDB storage of its {gb:.1f} GB of events, a month": gb * STORAGE_GB_MONTH_USD,
        "point-in-time recovery of them (every table has it on), a month": gb * PITR_GB_MONTH_USD,
    }


def _usd(x: float) -> str:
    return f"${x:,.3f}" if x < 10 else f"${x:,.0f}"


def report(args: argparse.Namespace) -> None:
    import inspect

    import instantml
    from infra import template
    from instantml import limits

    started = time.perf_counter()
    parameters = template.load()["Parameters"]
    throttle = float(parameters["ThrottleRateLimit"]["Default"])
    auth_ttl = float(parameters.get("AuthorizerCacheSeconds", {}).get("Default", 0) or 0)
    batch = int(inspect.signature(instantml.init).parameters["batch_size"].default)
    functions = template.functions()
    memory = {name: _memory(f) for name, f in functions.items()}

    print("Issue 26's model: one job on AWS from the real handlers on moto, every DynamoDB call metered\n")
    print("inputs:")
    print(
        f"  job: {args.ranks} ranks x {args.keys} keys a step, {args.steps:,} steps, at {args.rates} steps/s"
    )
    print(
        f"  uploaders: linger {limits.UPLOAD_LINGER_S:g} s or {batch} events (limits.UPLOAD_LINGER_S, "
        f"init's batch_size); every rank's phase random"
    )
    print(
        f"  template: stage throttle {throttle:g} requests/s, authorizer cache {auth_ttl:g} s, memory "
        + ", ".join(f"{n.removesuffix('Function')} {m} MB" for n, m in memory.items())
    )
    print(
        f"  prices: write unit ${WRITE_UNIT_USD * 1e6:.3f}/M, read unit ${READ_UNIT_USD * 1e6:.3f}/M, "
        f"API ${API_REQUEST_USD * 1e6:.2f}/M requests, Lambda ${LAMBDA_REQUEST_USD * 1e6:.2f}/M + "
        f"${LAMBDA_GB_SECOND_USD:.10f}/GB-s, logs ${LOG_GB_USD:.2f}/GB, storage "
        f"${STORAGE_GB_MONTH_USD:.2f}/GB-month, stream reads by Lambda $0"
    )
    print(
        f"  Lambda duration: CPU here x {FULL_VCPU_MB}/memory MB + {LATENCY_S * 1e3:g} ms per DynamoDB "
        f"round trip (puts 16 at a time); {PLATFORM_LOG_BYTES} bytes of platform and access log a request"
    )
    from shared.summary.rolling import SETTLE_STEPS

    batch_steps = {}  # the new steps a stream batch brings, at each rate
    for rate in args.rates:
        _, batches_per_s = rolls_per_block(Job(args.ranks, args.keys, rate, limits.UPLOAD_LINGER_S, batch))
        batch_steps[rate] = math.ceil(rate / batches_per_s)
    fastest = Job(args.ranks, args.keys, max(args.rates), limits.UPLOAD_LINGER_S, batch)
    tail = SETTLE_STEPS + batch_steps[fastest.rate]
    refresh = math.ceil(fastest.rate * TAB_REFRESH_S)
    print(
        f"  samples: {args.sample_events:,} events of ingest per rate; rollups and summaries at "
        f"{args.ranks} ranks; a live run's newest {tail} steps beyond the rollups' mark (SETTLE_STEPS "
        f"{SETTLE_STEPS} + a stream batch's {tail - SETTLE_STEPS} at {fastest.rate:g} steps/s), its tab "
        f"refreshed every {TAB_REFRESH_S:g} s ({refresh} steps later); a stream batch brings "
        + ", ".join(f"{n} steps at {rate:g} steps/s" for rate, n in batch_steps.items())
    )

    with metered_deployment() as (refs, meter):
        samples = []
        for rate in args.rates:
            job = Job(args.ranks, args.keys, rate, limits.UPLOAD_LINGER_S, batch)
            samples.append(run_ingest(job, meter, refs, args.sample_events, f"rate-{rate:g}"))
        fastest_sample = samples[-1]
        team_instances = math.ceil(
            TEAM_RUNS
            * fastest.requests_per_s
            * statistics.mean(c.duration_s(memory["IngestFunction"]) for c in fastest_sample.ingest[1:])
            * 1.5
        )
        team = run_ingest(
            fastest, meter, refs, args.sample_events, team_run(0), instances_of_team=team_instances
        )
        measured = run_rollup_and_summaries(
            meter, refs, args.ranks, args.keys, args.steps, list(batch_steps.values()), tail, refresh
        )
        meter.detach()
    starts = cold_starts()
    uri, n_files, code_bytes = code_root()

    cost_rows: list[tuple[str, list[float]]] = []
    per_rate: list[dict[str, Any]] = []
    for s in samples:
        job, bill = s.job, s.bill
        seconds = s.seconds
        item_rate = max(bill.item_wcu.values()) / seconds
        busiest_item = max(bill.item_wcu, key=bill.item_wcu.__getitem__)
        partition_rate = max(bill.partition_wcu.values()) / seconds
        busiest_partition = max(bill.partition_wcu, key=bill.partition_wcu.__getitem__)
        rolls, batches_per_s = rolls_per_block(job)
        roll = measured[f"roll {batch_steps[job.rate]}"]  # a stream batch's new steps at this rate
        events_per_block = job.ranks * batch_steps[job.rate]
        rollup_rcu_per_event = rolls * roll.rcu / events_per_block
        rollup_wcu_per_event = rolls * roll.call.bill.total_wcu / events_per_block
        wcu_per_event = bill.total_wcu / s.events + rollup_wcu_per_event
        requests_per_event = 1 / (job.interval * job.rate)
        ingest_memory = memory["IngestFunction"]
        duration = statistics.mean(c.duration_s(ingest_memory) for c in s.ingest)
        log_bytes = statistics.mean(c.log_bytes for c in s.ingest) + PLATFORM_LOG_BYTES
        authorizer_per_event = (1 / auth_ttl if auth_ttl else job.requests_per_s) / job.events_per_s
        roll_duration = roll.call.duration_s(memory["RollupFunction"])
        idle_duration = measured["idle roll"].call.duration_s(memory["RollupFunction"])
        rollup_invocations_per_event = batches_per_s / job.events_per_s
        rollup_gbs_per_event = (
            (rolls * roll_duration / events_per_block + rollup_invocations_per_event * idle_duration)
            * memory["RollupFunction"]
            / 1024
        )
        cost = {
            "DynamoDB writes": wcu_per_event * WRITE_UNIT_USD,
            "DynamoDB reads (rollups)": rollup_rcu_per_event * READ_UNIT_USD,
            "API Gateway": requests_per_event * API_REQUEST_USD,
            "ingest Lambda": requests_per_event
            * (LAMBDA_REQUEST_USD + duration * ingest_memory / 1024 * LAMBDA_GB_SECOND_USD),
            "authorizer Lambda": authorizer_per_event
            * (
                LAMBDA_REQUEST_USD
                + s.authorizer.duration_s(memory["AuthorizerFunction"])
                * memory["AuthorizerFunction"]
                / 1024
                * LAMBDA_GB_SECOND_USD
            ),
            "rollup Lambda": rollup_invocations_per_event * LAMBDA_REQUEST_USD
            + rollup_gbs_per_event * LAMBDA_GB_SECOND_USD,
            "logs": (
                log_bytes * requests_per_event
                + (roll.call.log_bytes + PLATFORM_LOG_BYTES) * rollup_invocations_per_event
            )
            / 1e9
            * LOG_GB_USD,
            "stream": STREAM_READ_USD,
        }
        per_million = {k: v * 1e6 for k, v in cost.items()}
        total = sum(per_million.values())
        item_bytes = _event_item_bytes(args.keys)
        stored = item_bytes + ITEM_OVERHEAD_BYTES
        per_rate.append(
            {
                "job": job,
                "sample": s,
                "item_rate": item_rate,
                "busiest_item": busiest_item,
                "partition_rate": partition_rate,
                "busiest_partition": busiest_partition,
                "rolls": rolls,
                "wcu_per_event": wcu_per_event,
                "duration": duration,
                "log_bytes": log_bytes,
                "per_million": per_million,
                "total": total,
                "stored": stored,
                "item_bytes": item_bytes,
            }
        )
        cost_rows.append((f"{job.rate:g} steps/s", list(per_million.values())))

    print("\ningest samples (the real handlers on moto):")
    for r in per_rate:
        s, job = r["sample"], r["job"]
        calls = s.bill.calls
        print(
            f"  {job.rate:g} steps/s: {s.requests:,} requests of {s.events / s.requests:.1f} events over "
            f"{s.seconds:.1f} s of the job, {s.instances} ingest instances; statuses {dict(s.statuses)}; "
            f"calls {dict(calls)}; failed conditions {s.bill.failed_conditions}"
        )
        print(f"    write units: {dict(s.bill.wcu)} ({r['wcu_per_event']:.3f} a stored event with rollups)")
        print(
            f"    busiest item {r['busiest_item'][0]} {r['busiest_item'][1]}: {r['item_rate']:.1f} "
            f"write units/s; busiest partition {r['busiest_partition']}: {r['partition_rate']:.1f}/s"
        )
        print(
            f"    ingest duration {r['duration'] * 1e3:.1f} ms a request at {memory['IngestFunction']} MB "
            f"(CPU {statistics.mean(c.cpu_s for c in s.ingest) * 1e3:.1f} ms here); log "
            f"{r['log_bytes']:.0f} bytes a request; each block rolled up {r['rolls']:.2f} times"
        )

    loads = team_key_loads(team, TEAM_RUNS)
    print_team(team, loads, team_instances, fastest)

    print("\nrollups and summaries (the real handlers on moto):")
    for m in measured.values():
        b = m.call.bill
        print(
            f"  {m.name}: read {sum(b.items_read.values()):,} items, {b.total_rcu:,.1f} read units, "
            f"{b.total_wcu} write units, CPU {m.call.cpu_s:.2f} s here, answer {m.body_bytes:,} bytes. "
            f"{m.notes}"
        )

    print("\nfigures:")
    goals = []

    def figure(name: str, values: list[str], goal: str, ok: bool | None = None) -> None:
        mark = "" if ok is None else ("  ok" if ok else "  OVER")
        goals.append(ok)
        print(f"  {name:58} {' | '.join(values):40} goal {goal}{mark}")

    last = per_rate[-1]
    figure(
        f"write units/s, busiest item and partition ({last['job'].rate:g} steps/s)",
        [f"item {last['item_rate']:.0f}", f"partition {last['partition_rate']:.0f}"],
        "<= 500",
        max(last["item_rate"], last["partition_rate"]) <= 500,
    )
    (where, key), busiest = max(loads.items(), key=lambda kv: kv[1])
    figure(
        f"busiest key, {TEAM_RUNS} live {fastest.ranks}-rank runs, one project, {fastest.rate:g} steps/s",
        [f"{busiest:.0f} write units/s", f"{where} {key}"],
        "<= 500",
        busiest <= 500,
    )
    for r in per_rate:
        figure(
            f"API requests/s at {r['job'].rate:g} steps/s, against the throttle",
            [
                f"{r['job'].requests_per_s:.1f}/s",
                f"{100 * r['job'].requests_per_s / throttle:.0f}% of {throttle:g}",
            ],
            "<= 50%",
            r["job"].requests_per_s <= throttle / 2,
        )
    for r in per_rate:
        figure(
            f"all-in cost per million events at {r['job'].rate:g} steps/s",
            [_usd(r["total"])],
            "<= $0.50",  # issue 41's goal (issue 26's was $1.00)
            r["total"] <= 0.5,
        )
    raw = measured["raw"]
    cpu = raw.call.cpu_s * max(1.0, FULL_VCPU_MB / memory["SummarizeFunction"])
    figure(
        "worst summary (raw mode): items, read units, CPU, body as base64",
        [f"{raw.items:,}", f"{raw.rcu:,.0f} RU", f"{cpu:.1f} s", f"{raw.body_bytes / 1e6:.1f} MB"],
        "<= 5 s; <= 6 MB",
        cpu <= 5 and raw.body_bytes <= 6e6,
    )
    long = measured["long"]
    cpu_long = long.call.cpu_s * max(1.0, FULL_VCPU_MB / memory["SummarizeFunction"])
    figure(
        f"summary of a live run at step {args.steps:,}: items, RU, CPU, base64",
        [f"{long.items:,}", f"{long.rcu:,.0f} RU", f"{cpu_long:.1f} s", f"{long.body_bytes / 1e6:.1f} MB"],
        "<= 5 s; <= 6 MB",
        cpu_long <= 5 and long.body_bytes <= 6e6,
    )
    again = measured["refresh"]
    cpu_again = again.call.cpu_s * max(1.0, FULL_VCPU_MB / memory["SummarizeFunction"])
    figure(
        f"its refresh {refresh} steps later (warm instance): items, RU, CPU, base64",
        [
            f"{again.items:,}",
            f"{again.rcu:,.0f} RU",
            f"{cpu_again:.1f} s",
            f"{again.body_bytes / 1e6:.2f} MB",
        ],
        "<= 5 s; <= 6 MB",
        cpu_again <= 5 and again.body_bytes <= 6e6,
    )
    per_minute = again.rcu * 60 / TAB_REFRESH_S
    figure(
        f"read units a minute of a live tab at step {args.steps:,} (refreshes)",
        [f"{per_minute:,.0f}", f"{100 * per_minute / (PARTITION_READ_UNITS * 60):.1f}% of a partition"],
        "<= 10%",
        per_minute <= 0.1 * PARTITION_READ_UNITS * 60,
    )
    slowest = max(starts, key=lambda n: starts[n].at_memory_s)
    figure(
        "cold start imports, CPU at the function's memory (slowest)",
        [f"{starts[slowest].at_memory_s:.2f} s", slowest.removesuffix("Function")],
        "<= 0.5 s",
        starts[slowest].at_memory_s <= 0.5,
    )
    print(f"  {'deployed code root (CodeUri ' + uri + ')':58} {n_files:,} files, {code_bytes / 1e6:.2f} MB")
    print(
        f"  cold start imports (CPU here / at the function's memory / wall here; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
        + ", ".join(
            f"{n.removesuffix('Function')} {c.cpu_s:.2f}/{c.at_memory_s:.2f}/{c.wall_s:.2f} s"
            for n, c in starts.items()
        )
    )

    rate0 = per_rate[0]
    start_rows = job_start_rows(args.ranks, rate0["job"].interval, starts, rate0["sample"], auth_ttl)
    print_job_start(start_rows)
    spread_figures = start_rows[0][1]
    figure(
        f"requests throttled in the first minute of a {args.ranks}-rank job; events lost",
        [f"{100 * spread_figures.throttled_share:.2f}%", "0 (retried)"],
        "<= 1%; 0",
        spread_figures.throttled_share <= 0.01,
    )

    print("\ncost per million events (USD):")
    names = list(per_rate[0]["per_million"])
    print(f"  {'':26}" + "".join(f"{name:>26}" for name, _ in cost_rows))
    for i, name in enumerate(names):
        print(f"  {name:26}" + "".join(f"{_usd(values[i]):>26}" for _, values in cost_rows))
    print(f"  {'all-in':26}" + "".join(f"{_usd(sum(values)):>26}" for _, values in cost_rows))
    for r in per_rate:
        job = r["job"]
        events = job.ranks * args.steps
        month = job.events_per_s * 86400 * 30
        gb = events * r["stored"] / 1e9
        print(
            f"  at {job.rate:g} steps/s: {_usd(r['total'] * events / 1e6)} for one {args.steps:,}-step run "
            f"({events / 1e6:.1f}M events), {_usd(r['total'] * month / 1e6)} a month logging around the "
            f"clock; {gb:.1f} GB stored a run ({r['stored']} bytes an event), "
            f"{_usd(gb * STORAGE_GB_MONTH_USD)} a month while kept"
        )

    for r in per_rate:
        day = day_bill(r, again, memory)
        total = sum(day.values())
        events = r["job"].events_per_s * 86400
        print(
            f"\na 24-hour {r['job'].ranks}-rank job at {r['job'].rate:g} steps/s with one tab open, all-in "
            f"({events / 1e6:.1f}M events; its storage for a month): {_usd(total)}, "
            f"{_usd(total / events * 1e6)} per million events"
        )
        for name, usd in day.items():
            print(f"  {name:78} {_usd(usd):>9}")
        print(
            "  alerts, deliver, their queues and the watch's nudge bus: $0 on a healthy job (they run per "
            "alert and per failed process); the watch's schedule (EventBridge) is free"
        )
        if r is per_rate[0]:
            figure(
                f"a 24-hour {r['job'].ranks}-rank job at {r['job'].rate:g} step/s, one tab open, all-in",
                [_usd(total), f"{_usd(total / events * 1e6)}/M events"],
                "<= $25",
                total <= 25,
            )

    print(f"\nitems sized for the job (event write units a stored event, {args.keys} keys; notes apart):")
    for r in per_rate:
        job = r["job"]
        for name, units, caveat in packing(job, r["item_bytes"]):
            print(f"  {job.rate:g} steps/s, {name}: {units:.2f}{caveat}")
    print(
        "  -> one item per event: the only layout that keeps the promise per event (an id stored once,\n"
        "     whatever batch it comes in) without paying each append on a whole item; packing a rank's\n"
        "     steps with an id check would save 60-80% of the event writes, but every reader of events\n"
        "     (summary, rollups, watch) would unpack items: left for after the summary's levels (issue 27)."
    )
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


#: What a packed item holds besides its events: its keys (partition, sort) and a header.
PACKED_ITEM_BYTES = 80
#: An event inside a packed item: its 32-character id, step, and the item's bytes of its values.
PACKED_ID_BYTES = 32 + 8


def packing(job: Job, item_bytes: int) -> list[tuple[str, float, str]]:
    """Event write units a stored event for the ways of laying events out (the model's decision)."""
    per_request = max(1, round(job.interval * job.rate))
    payload = item_bytes - 60  # an event item less its keys and digest: what a packed event carries
    event = payload + PACKED_ID_BYTES

    def units(n: int) -> int:
        return math.ceil((PACKED_ITEM_BYTES + n * event) / 1024)

    # A rank's block of ``per_request`` steps, appended to by each request that reaches it (a request
    # covers the same number of steps, at a random phase: two appends a block, the first of a share f).
    appends = statistics.mean(
        units(max(1, round(f * per_request))) + units(per_request) for f in (i / 20 for i in range(1, 20))
    )
    return [
        ("one item per event (this layout)", 1.0 * math.ceil(item_bytes / 1024), ""),
        (
            f"a rank's request ({per_request} events) as one item",
            units(per_request) / per_request,
            " (an id then is unique per batch only: a spool replayed after a crash re-batches its lines"
            " and would store events twice)",
        ),
        (
            f"a rank's block of {per_request} steps, each request appending with a check of its ids",
            appends / per_request,
            " (each append billed on the whole item; a late or replayed event rewrites its block)",
        ),
        ("a rank's request as one item, plus an id item per event", 1 + units(per_request) / per_request, ""),
    ]


def _event_item_bytes(keys: int) -> int:
    """The size of one event's item as the ingest function writes it (``keys`` keys of the model)."""
    from benchmarks.metering import item_size
    from shared.events import RankEvent
    from shared.store.dynamodb import item_of

    names = KEY_NAMES[:keys]
    event = RankEvent(
        PROJECT,
        "r" * 12,
        "e" * 32,
        50_000,
        511,
        512,
        7,
        1.0,
        1.8e9,
        names,
        tuple(1.0 for _ in names),
        b"\0" * 16,
    )
    return item_size(item_of(event))


@contextlib.contextmanager
def metered_deployment() -> Iterator[tuple[dict[str, str], Meter]]:
    """The template's tables (and queues) in moto, every function's environment set for them, the
    token ``TOKEN`` of ``PROJECT``, and a :class:`Meter` on every boto3 client made from now on:
    (refs, meter)."""
    from benchmarks.watch_dynamodb import moto_tables
    from infra import template

    for name, value in (("AWS_ACCESS_KEY_ID", "model"), ("AWS_SECRET_ACCESS_KEY", "model")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with moto_tables() as refs:
        for function in template.functions():
            for name, value in template.environment(function, refs).items():
                os.environ[name] = value
        import boto3

        from shared.store.dynamodb import DynamoTokenStore

        DynamoTokenStore(refs["TokensTable"]).create(PROJECT, "model", token=TOKEN)
        tables = {
            refs[name]: Table.from_definition(refs[name], template.table_definition(name))
            for name in template.tables()
        }
        boto3.setup_default_session()
        meter = Meter(tables, moto_item_reader())
        meter.attach()
        try:
            yield refs, meter
        finally:
            meter.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 5.0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sample-events", type=int, default=6000)
    parser.add_argument(
        "--start-only", action="store_true", help="only the first minute of the job (a few minutes less)"
    )
    args = parser.parse_args()
    if args.start_only:
        start_only(args)
        return
    report(args)


def start_only(args: argparse.Namespace) -> None:
    """The first minute of the job alone: the durations from a short ingest sample at the first rate."""
    import inspect

    import instantml
    from infra import template
    from instantml import limits

    batch = int(inspect.signature(instantml.init).parameters["batch_size"].default)
    auth_ttl = float(template.load()["Parameters"]["AuthorizerCacheSeconds"]["Default"])
    job = Job(args.ranks, args.keys, args.rates[0], limits.UPLOAD_LINGER_S, batch)
    with metered_deployment() as (refs, meter):
        sample = run_ingest(job, meter, refs, min(args.sample_events, 1500), "start")
    print_job_start(job_start_rows(args.ranks, job.interval, cold_starts(), sample, auth_ttl))


if __name__ == "__main__":
    main()
