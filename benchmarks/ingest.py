"""Ingest figures: handler CPU time per event, cold import, write units per event, and cost per million.

    .venv/bin/python benchmarks/ingest.py [--rounds 3]

Handler time is the real ``lambda_handler`` with real API Gateway HTTP API events (token check,
parsing, validation, the store's conditional puts, EMF metrics and logs), per event, for the single
route and for batches of 100 and 1,000, against an in-memory fake of the DynamoDB client (the cost of
our code alone) and against moto in-process (adds botocore's serialisation and moto's work). Medians of
``--rounds`` rounds measured side by side in one run, and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# us-east-1 on-demand list prices (../shared/engineering/benchmarks.md).
DYNAMODB_PER_MILLION_WRITE_UNITS = 0.625
HTTP_API_PER_MILLION_REQUESTS = 1.00
LAMBDA_PER_MILLION_REQUESTS = 0.20
LAMBDA_PER_GB_SECOND = 0.0000166667
#: Assumed latency of one conditional PutItem from Lambda in the same region (single-digit ms).
DYNAMODB_PUT_LATENCY_S = 0.005


class FakeDynamoDB:
    """``put_item`` with ``attribute_not_exists`` and ``ALL_OLD``, in a dict: the store's code path
    without any network or emulator. Every other call (the run record's notes, at most about one a
    second per run) goes to ``other``."""

    def __init__(self, other: Any) -> None:
        self.items: dict[tuple[str, str], dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.other = other

    def __getattr__(self, name: str) -> Any:
        return getattr(self.other, name)

    def put_item(self, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        item = kwargs["Item"]
        key = (item["pk"]["S"], item["sk"]["S"])
        with self.lock:
            old = self.items.get(key)
            if old is None:
                self.items[key] = item
                return {}
        error = {"Error": {"Code": "ConditionalCheckFailedException", "Message": "failed"}, "Item": old}
        raise ClientError(error, "PutItem")  # type: ignore[arg-type]


def sample_event(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((ROOT / "events" / name).read_text())
    return event


def rank_event(i: int) -> dict[str, Any]:
    return {
        "step": i // 8,
        "rank": i % 8,
        "world_size": 8,
        "local_rank": i % 8,
        "weight": 1024,
        "metrics": {"train/loss": 0.1 + i * 1e-6, "optimizer/grad_norm": 3.4},
        "time": 1764672000.123,
    }


class Context:
    function_name = "bench"
    memory_limit_in_mb = 1024
    invoked_function_arn = "arn:aws:lambda:us-east-1:000000000000:function:bench"
    aws_request_id = "bench"


def time_handler(handler: Any, make_requests: Any, events_per_request: int) -> float:
    """CPU seconds of this thread per event over the requests ``make_requests()`` returns (built before
    the clock starts). CPU, not wall time: what the handler costs, whatever else the 2 cores run."""
    requests = make_requests()
    started = time.thread_time()
    for request in requests:
        response = handler(request, Context())
        assert response["statusCode"] in (200, 201), response
    return (time.thread_time() - started) / (len(requests) * events_per_request)


def handler_times(rounds: int) -> dict[tuple[str, str], float]:
    """Median seconds per event for (route shape, store)."""
    import boto3
    from moto import mock_aws

    os.environ.update(
        METRICS_TABLE="bench-metrics",
        RUNS_TABLE="bench-runs",
        API_TOKEN_SHA256="2c6f2a3f0c76bb4fd1f7d09d1d3bd7de05c5dc0a2d5a1e6b0b7fdba5b27b6d0a",
        POWERTOOLS_SERVICE_NAME="instantml",
        POWERTOOLS_METRICS_NAMESPACE="InstantML",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
    )
    import hashlib

    os.environ["API_TOKEN_SHA256"] = hashlib.sha256(b"sample-token").hexdigest()
    from infra import template

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):  # the EMF documents and log lines are produced, not shown
        from functions.ingest import app as ingest

        single, batch = sample_event("post_rank_metrics.json"), sample_event("post_rank_metrics_batch.json")
        counter = iter(range(10**9))

        def singles(n: int) -> Any:
            def make() -> list[dict[str, Any]]:
                out = []
                for _ in range(n):
                    i = next(counter)
                    request = json.loads(json.dumps(single))
                    request["body"] = json.dumps(rank_event(i))
                    request["headers"]["idempotency-key"] = f"bench-{i}"
                    out.append(request)
                return out

            return make

        def batches(size: int, n: int) -> Any:
            def make() -> list[dict[str, Any]]:
                out = []
                for _ in range(n):
                    events = []
                    for _ in range(size):
                        i = next(counter)
                        events.append({"event_id": f"bench-{i}", **rank_event(i)})
                    request = json.loads(json.dumps(batch))
                    request["body"] = json.dumps({"events": events})
                    out.append(request)
                return out

            return make

        shapes = {"single": (singles(300), 1), "batch of 100": (batches(100, 6), 100)}
        shapes["batch of 1000"] = (batches(1000, 2), 1000)
        results: dict[tuple[str, str], list[float]] = {}
        with mock_aws():
            client = boto3.client("dynamodb")
            client.create_table(TableName="bench-metrics", **template.table_definition("MetricsTable"))
            client.create_table(TableName="bench-runs", **template.table_definition("RunsTable"))
            store = ingest.store()
            fake = FakeDynamoDB(client)
            for _ in range(rounds):
                for shape, (make, per_request) in shapes.items():
                    for name, backend in (("fake", fake), ("moto", client)):
                        store._client = backend
                        seconds = time_handler(ingest.lambda_handler, make, per_request)
                        results.setdefault((shape, name), []).append(seconds)
                sink.seek(0)
                sink.truncate()
    return {key: statistics.median(values) for key, values in results.items()}


COLD_IMPORT = """
import sys, time
t = time.perf_counter()
import {module}
imported = time.perf_counter() - t
print(imported, "numpy" in sys.modules, "boto3" in sys.modules)
"""


def cold_import(module: str, rounds: int) -> tuple[float, float, bool, bool]:
    """Median and fastest seconds to import ``module`` in a fresh interpreter, and what it loaded."""
    times, numpy_loaded, boto3_loaded = [], False, False
    env = dict(os.environ, METRICS_TABLE="bench")
    for _ in range(max(7, rounds)):
        out = subprocess.run(
            [sys.executable, "-c", COLD_IMPORT.format(module=module)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        times.append(float(out[0]))
        numpy_loaded |= out[1] == "True"
        boto3_loaded |= out[2] == "True"
    return statistics.median(times), min(times), numpy_loaded, boto3_loaded


def write_units() -> list[tuple[str, int, int]]:
    """(event, item bytes, write units) for typical and extreme events."""
    from shared.ingest.bodies import validate_body
    from shared.ingest.parse import to_event
    from shared.store.dynamodb import item_of, item_size
    from shared.store.dynamodb import write_units as units

    cases = {
        "2 keys (the sample event)": rank_event(0),
        "20 keys of 20 chars": {
            **rank_event(0),
            "metrics": {f"group/metric-{i:06d}": 1.5 for i in range(20)},
        },
        "256 keys of 255 chars (the 64 KiB limit)": {
            **rank_event(0),
            "metrics": {f"k{i:03d}" + "x" * 251: 1.5 for i in range(256)},
        },
    }
    rows = []
    for name, body in cases.items():
        event = to_event("distributed-job", "r1", validate_body(body), os.urandom(16).hex(), 0.0)
        item = item_of(event)
        rows.append((name, item_size(item), units(item)))
    return rows


def cost_per_million(batch_size: int, seconds_per_event_cpu: float, units_per_event: int) -> dict[str, float]:
    """Dollars per million events through the batch route, by component."""
    from infra import template
    from shared.store.dynamodb import PUT_CONCURRENCY

    requests = 1e6 / batch_size
    memory_gb = int(template.functions()["IngestFunction"]["MemorySize"]) / 1024
    # Duration: our CPU time (measured against the fake store) plus waves of concurrent puts.
    duration = seconds_per_event_cpu * batch_size + math.ceil(batch_size / PUT_CONCURRENCY) * (
        DYNAMODB_PUT_LATENCY_S
    )
    return {
        "API Gateway HTTP API requests": requests * HTTP_API_PER_MILLION_REQUESTS / 1e6,
        "Lambda requests": requests * LAMBDA_PER_MILLION_REQUESTS / 1e6,
        f"Lambda duration ({memory_gb:g} GB x {duration * 1e3:.0f} ms per batch)": requests
        * memory_gb
        * duration
        * LAMBDA_PER_GB_SECOND,
        "DynamoDB writes": 1e6 * units_per_event * DYNAMODB_PER_MILLION_WRITE_UNITS / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    print(f"# ingest benchmark, Python {sys.version.split()[0]}, medians of {args.rounds} rounds")
    # boto3 (138 ms in ../shared/engineering/benchmarks.md) measured alongside: the machine is noisy.
    median, fastest, numpy_loaded, boto3_loaded = cold_import("functions.ingest.app", args.rounds)
    boto3_median, boto3_fastest, _, _ = cold_import("boto3", args.rounds)
    print(
        f"cold import of functions.ingest.app: median {median * 1e3:.0f} ms, fastest {fastest * 1e3:.0f} ms "
        f"(goal <= 250 ms); numpy loaded: {numpy_loaded}; boto3 loaded: {boto3_loaded} (on first request)"
    )
    print(
        f"  reference, import boto3 in the same run: median {boto3_median * 1e3:.0f} ms, fastest "
        f"{boto3_fastest * 1e3:.0f} ms; ingest/boto3 = {median / boto3_median:.2f}x"
    )

    times = handler_times(args.rounds)
    print("\nhandler CPU time per event (us) fake store      moto   moto/fake")
    for shape in ("single", "batch of 100", "batch of 1000"):
        fake, moto = times[(shape, "fake")], times[(shape, "moto")]
        print(f"  {shape:<26} {fake * 1e6:>12.0f} {moto * 1e6:>9.0f} {moto / fake:>10.1f}x")
    single = times[("single", "fake")]
    for shape in ("batch of 100", "batch of 1000"):
        print(f"  single / {shape} (fake store): {single / times[(shape, 'fake')]:.1f}x")

    print("\nwrite units per event (1 per started KB of item)")
    rows = write_units()
    for name, size, units in rows:
        print(f"  {name:<42} {size:>6} bytes  {units:>3} WCU")
    print("  a replay (duplicate or reused id) costs 1 more: a failed conditional write is billed")

    typical_units = rows[0][2]
    print(f"\ncost per million events through the batch route ({typical_units} WCU per event)")
    for batch_size, shape in ((100, "batch of 100"), (1000, "batch of 1000")):
        parts = cost_per_million(batch_size, times[(shape, "fake")], typical_units)
        total = sum(parts.values())
        goal = " (goal <= $0.75)" if batch_size == 100 else ""
        print(f"  {batch_size} events per batch: ${total:.3f}{goal}")
        for name, dollars in parts.items():
            print(f"    {name:<52} ${dollars:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
