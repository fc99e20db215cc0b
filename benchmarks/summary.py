"""The Distributed summary's cost: statistics against a bare numpy floor, decoding, the handler, memory,
and a 512-rank x 100,000-step run summarized from its levels of rollups.

    .venv/bin/python -m benchmarks.summary [--rounds 5] [--skip-handler] [--skip-long]

- statistics: what the summary computes per key on a ranks x steps matrix (reducers, z, robust scores,
  rank noise, findings), 3 keys, against the floor measured in the same run: a sort per column with
  the three percentiles interpolated, plus mean and std, over the same matrices. Median of the rounds.
- decode: stored items (as the store returns them) to the flat arrays, per item.
- summarize: decoded run to the whole document (units, statistics, findings, JSON lists).
- handler: the real summarize function with a real API Gateway event over moto at 64 x 1,000.
- peak memory: tracemalloc's peak while summarizing (numpy reports its buffers to it).
- rolling up: the rollup function's work for one 512-rank x 100-step range (51,200 events): decode,
  the 100 level-1 blocks (``rollups.roll_steps``) and the blocks above them (``rollups.combine``).
- long run: 512 ranks x 100,000 steps, 3 keys, rank 11 stopped at step 499, as the rollup function
  leaves it: 1,000 level-100 blocks and the 100 level-1,000 and 10 level-10,000 blocks combined from
  them, written to moto with the progress mark at the last step (``advance_rollups``). The levels 1 and
  10 are not written (1.1 M blocks; a 100,000-step window never reads them), nor the raw events but
  step 0's (the summary looks for the window's first step among the events). One summary at the
  default ``max_steps`` (200: it reads the level-100 blocks) and one at ``max_steps=100`` (the level-1,000
  blocks) through the real store, their bodies plain and gzipped, and the bytes a summary reads.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared import (  # noqa: E402
    findings,
    rollups,
    stats,
)
from shared.summary.decoding import decode  # noqa: E402
from shared.summary.document import summarize  # noqa: E402
from shared.summary.query import SummaryQuery  # noqa: E402
from tests.synthetic import KEYS, synthetic_job, synthetic_matrices  # noqa: E402

SHAPES = ((8, 1_000), (64, 10_000), (512, 1_000))


def timed(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floor(matrices: list[np.ndarray]) -> None:
    for m in matrices:
        ordered = np.sort(m, axis=0)
        last = m.shape[0] - 1
        for q in (0.05, 0.5, 0.95):
            pos = last * q
            lo = int(np.floor(pos))
            hi = min(lo + 1, last)
            _ = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
        m.mean(axis=0)
        m.std(axis=0)


def statistics_of(matrices: list[np.ndarray], weights: np.ndarray) -> None:
    cols = matrices[0].shape[1]
    columns = np.arange(cols)
    none = np.zeros(matrices[0].shape, bool)
    for key, m in zip(KEYS, matrices, strict=True):
        red = stats.reducers(m, weights)
        stats.zscores(m, red.mean, red.std)
        stats.robust_scores(m, red.p50, red.mad)
        findings.key_findings(key, m, weights, red, none, ~none, columns, 1)


def bench_statistics(rounds: int) -> None:
    """The floor and the statistics timed alternately (drift on a shared machine hits both alike), as
    many rounds as fit in about a second per size but at least ``rounds``; medians."""
    print(f"statistics per summary (3 keys), interleaved with the floor, median of at least {rounds} rounds")
    for ranks, steps in SHAPES:
        values, weights, _ = synthetic_matrices(ranks, steps, seed=1)
        matrices = [np.ascontiguousarray(values[:, :, k]) for k in range(3)]
        once = timed(lambda m=matrices, w=weights: statistics_of(m, w), 1)
        n = max(rounds, min(1000, int(1.0 / max(once, 1e-6))))
        floors, stats_times = [], []
        for _ in range(n):
            floors.append(timed(lambda matrices=matrices: floor(matrices), 1))
            stats_times.append(timed(lambda m=matrices, w=weights: statistics_of(m, w), 1))
        t_floor, t_stats = statistics.median(floors), statistics.median(stats_times)
        print(
            f"  {ranks:>3} x {steps:>6}: statistics {t_stats * 1e3:8.2f} ms   "
            f"floor {t_floor * 1e3:7.2f} ms   ratio {t_stats / t_floor:4.1f}x   ({n} rounds)"
        )


def bench_decode_and_summarize(rounds: int) -> None:
    print("decode and whole summary (3 keys, max_steps=200)")
    for ranks, steps in ((8, 1_000), (64, 1_000), (512, 1_000), (64, 10_000)):
        events = synthetic_job(ranks, steps, seed=1)
        t_decode = timed(lambda events=events: decode(events), rounds)
        run = decode(events)
        tracemalloc.start()
        start = time.perf_counter()
        document = summarize(run, "p", "r", SummaryQuery())
        t_first = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        t_summary = min(t_first, timed(lambda run=run: summarize(run, "p", "r", SummaryQuery()), rounds))
        t_json = timed(lambda d=document: json.dumps(d), rounds)
        print(
            f"  {ranks:>3} x {steps:>6} ({len(events):>7} items): "
            f"decode {t_decode / len(events) * 1e6:5.2f} us/item ({t_decode * 1e3:7.1f} ms)   "
            f"summarize {t_summary * 1e3:7.1f} ms   json {t_json * 1e3:6.1f} ms   "
            f"peak {peak / 2**20:6.1f} MiB   body {len(json.dumps(document)) / 2**20:5.2f} MiB"
        )


def _moto_env() -> Any:
    import boto3
    from moto import mock_aws

    from infra import template

    os.environ.update(AWS_DEFAULT_REGION="us-east-1", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")
    os.environ.pop("AWS_ENDPOINT_URL_DYNAMODB", None)
    mock = mock_aws()
    mock.start()
    client = boto3.client("dynamodb")
    client.create_table(TableName="bench", **template.table_definition("MetricsTable"))
    # The summary function notes a full summary's findings on the run's record (functions/summarize).
    client.create_table(TableName="bench-runs", **template.table_definition("RunsTable"))
    os.environ.update(METRICS_TABLE="bench", RUNS_TABLE="bench-runs")
    return mock


def _put_raw(events: list[Any]) -> None:
    """Write events in the store's item layout with BatchWriteItem (loading only; not what is measured)."""
    import boto3

    from shared.store.dynamodb import PARTITION_KEY, SHARDS, SORT_KEY, partition_key, sort_key

    client = boto3.client("dynamodb")
    items = [
        {
            PARTITION_KEY: {"S": partition_key("p", "r", e.rank % SHARDS)},
            SORT_KEY: {"S": sort_key(e.step, e.event_id)},
            "r": {"N": str(e.rank)},
            "ws": {"N": str(e.world_size)},
            "k": {"S": "\n".join(e.keys)},
            "v": {"B": e.packed},
            "h": {"B": b"0" * 16},
        }
        for e in events
    ]
    for i in range(0, len(items), 25):
        batch = [{"PutRequest": {"Item": it}} for it in items[i : i + 25]]
        client.batch_write_item(RequestItems={"bench": batch})


def bench_handler(rounds: int) -> None:
    import importlib

    from tests.conftest import Context, load_event

    mock = _moto_env()
    try:
        events = synthetic_job(64, 1_000, seed=1)
        start = time.perf_counter()
        _put_raw(events)
        load = time.perf_counter() - start
        app = importlib.import_module("functions.summarize.app")
        event = load_event("get_distributed.json")
        path = event["rawPath"].split("/projects/")[0] + "/projects/p/runs/r/distributed"
        event["rawPath"] = event["requestContext"]["http"]["path"] = path
        event["pathParameters"] = {"project": "p", "run_id": "r"}
        event["requestContext"]["authorizer"]["lambda"]["project"] = "p"  # the authorizer's verdict
        event["headers"]["accept-encoding"] = "gzip"  # as a browser sends
        event["queryStringParameters"] = {}
        from shared.store.dynamodb import DynamoStore

        start = time.perf_counter()
        n_read = len(DynamoStore("bench").read_events("p", "r").events)
        t_query = time.perf_counter() - start
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            response = app.lambda_handler(event, Context())
            times.append(time.perf_counter() - start)
            assert response["statusCode"] == 200, response["body"][:300]
        zipped = base64.b64decode(response["body"])
        body = json.loads(gzip.decompress(zipped))
        print(
            f"handler over moto, 64 x 1,000 (64,000 items; loaded in {load:.0f} s): median "
            f"{statistics.median(times):.2f} s, first {times[0]:.2f} s "
            f"(resolution {body['resolution']['unit']}, {body['resolution']['events_read']} events read, "
            f"{len(zipped) / 2**20:.2f} MiB gzipped)"
        )
        print(
            f"  of which the store query through botocore and moto alone: {t_query:.2f} s for {n_read} items "
            f"({t_query / n_read * 1e6:.0f} us/item); the rest is decode, statistics and JSON"
        )
    finally:
        mock.stop()


def bench_long_statistics() -> None:
    """The long run's work without the store: unpack 3,000 rollup items (1,000 level-100 blocks x 3 keys),
    summarize, JSON."""
    from shared.summary.document import summarize_units

    ranks, n = 512, 1_000
    rng = np.random.default_rng(0)
    packed = {
        k: [
            rollups.pack_key_units(
                (1 + rng.normal(0, 0.002, ranks)) * 100,
                np.full(ranks, 100),
                np.full(ranks, 1e5),
                np.zeros(ranks, np.int64),
            )
            for _ in range(n)
        ]
        for k in KEYS
    }
    start = time.perf_counter()
    keys = {}
    for k in KEYS:
        parts = [rollups.unpack_key_units(b, ranks) for b in packed[k]]
        keys[k] = rollups.KeyUnits(*(np.stack([c[i] for c in parts], axis=1) for i in range(4)))
    first = np.arange(n) * 100
    units = rollups.Units(
        first, first + 99, np.full(n, 100), np.full(n, ranks), np.full((ranks, n), 100), keys,
        rank_first=np.tile(first, (ranks, 1)), rank_last=np.tile(first + 99, (ranks, 1)),
        raw_present=np.zeros((ranks, 0), bool),
    )  # fmt: skip
    t_unpack = time.perf_counter() - start
    start = time.perf_counter()
    document = summarize_units(units, list(KEYS), "p", "r", SummaryQuery())
    t_summary = time.perf_counter() - start
    start = time.perf_counter()
    json.dumps(document)
    t_json = time.perf_counter() - start
    print(
        f"long run without the store, 512 x 1,000 level-100 blocks x 3 keys: unpack {t_unpack * 1e3:.0f} ms, "
        f"summarize {t_summary * 1e3:.0f} ms, json {t_json * 1e3:.0f} ms"
    )


def bench_long_run() -> None:
    """512 x 100,000 with rank 11 stopped at step 499: the levels 100, 1,000 and 10,000 (every block
    from step 500 on incomplete: the headers carry per-rank counts), summarized through the real store
    over moto at two ``max_steps``."""
    from shared.rollups import BlockHeader, RolledBlock, combine
    from shared.store.dynamodb import DynamoStore
    from shared.summary.reads import distributed_summary

    size = 100
    ranks, steps, stopped, stop_block = 512, 100_000, 11, 5
    n_blocks = steps // size
    stop_step = stop_block * size - 1
    mock = _moto_env()
    try:
        rng = np.random.default_rng(0)
        store = DynamoStore("bench")
        blocks = []
        for b in range(n_blocks):
            present = np.full(ranks, size)
            if b >= stop_block:
                present[stopped] = 0
            keys = {}
            for k in KEYS:
                mean = 1.0 + rng.normal(0, 0.002, ranks)
                keys[k] = rollups.pack_key_units(
                    mean * present, present, 1000.0 * present, np.zeros(ranks, np.int64)
                )
            first = b * size
            last = first + size - 1
            reported = present > 0
            header = BlockHeader(
                size, b, first, last, size, ranks, int(present.sum()), list(keys), present,
                np.where(reported, first, -1), np.where(reported, last, -1),
                np.zeros(ranks, np.int64), present,
            )  # fmt: skip
            blocks.append(RolledBlock(header, keys))
        levels = {size: blocks}
        for finer, coarser in ((100, 1_000), (1_000, 10_000)):  # as the rollup function combines them
            parts = levels[finer]
            levels[coarser] = [
                combine(coarser, b, parts[b * 10 : b * 10 + 10]) for b in range(len(parts) // 10)
            ]
        written = [block for level in levels.values() for block in level]
        start = time.perf_counter()
        store.write_blocks("p", "r", written)
        store.advance_rollups("p", "r", steps - 1, b"")
        _put_raw(synthetic_job(ranks, 1, seed=1))  # step 0's events: where the run starts
        write = time.perf_counter() - start
        item_bytes = len(blocks[0].sums[KEYS[0]])
        expected = [("stopped_reporting", stopped, stop_step)]
        results = []
        for max_steps in (200, 100):
            tracemalloc.start()
            start = time.perf_counter()
            document = distributed_summary(store, "p", "r", SummaryQuery(max_steps=max_steps))
            total = time.perf_counter() - start
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert document is not None
            found = [
                (f["kind"], f["rank"], f["step"]) for f in document["findings"] if f["severity"] != "info"
            ]
            assert found == expected, (max_steps, found)
            start = time.perf_counter()
            body = json.dumps(document)
            t_json = time.perf_counter() - start
            gzipped = len(gzip.compress(body.encode(), 6))
            res = document["resolution"]
            level = res["level_steps"]
            assert res["rollup_blocks_read"] == len(levels[level]) and res["events_read"] == 0, res
            read_bytes = sum(len(b.header.packed()) + sum(map(len, b.sums.values())) for b in levels[level])
            results.append((max_steps, document, res, total, t_json, peak, body, gzipped, read_bytes))
        print(
            f"long run 512 x 100,000 (51.2 M values per key; rank {stopped} stopped at step {stop_step}) "
            f"from the levels 100, 1,000 and 10,000 ({n_blocks:,} + {len(levels[1_000])} + "
            f"{len(levels[10_000])} blocks written; writing them took {write:.0f} s over moto)"
        )
        for max_steps, document, res, total, t_json, peak, body, gzipped, read_bytes in results:
            print(
                f"  max_steps={max_steps}: level {res['level_steps']:,}, {res['rollup_blocks_read']} blocks "
                f"and {res['events_read']} events read: summary over moto {total:.2f} s "
                f"(json {t_json * 1e3:.0f} ms), peak {peak / 2**20:.0f} MiB, "
                f"{len(document['steps'])} columns of {document['bin_size']:,} steps, "
                f"body {len(body) / 2**20:.2f} MiB, gzipped {gzipped / 2**20:.2f} MiB"
            )
            print(
                f"    reads {read_bytes / 2**20:.1f} MiB of rollups ({item_bytes / 1024:.0f} KiB per key and "
                f"block, plus the headers), about {read_bytes / 4096 / 2:.0f} read units "
                f"(${read_bytes / 4096 / 2 * 0.125e-6:.5f}); findings: {expected}"
            )
        print(
            f"  the raw events would be 51.2 M items, about {51.2e6 * 130 / 2**30:.1f} GiB "
            f"(only step 0's {ranks} are stored here)"
        )
    finally:
        mock.stop()


def bench_rollup_block() -> None:
    """The rollup function's work for one 512-rank range of 100 steps (51,200 events), without the store:
    decode, the level-1 blocks, and the blocks above them combined level by level (as
    ``shared.summary.rolling.roll_up`` makes them: the levels 1,000 and 10,000 get a block of that one
    part)."""
    from shared.summary.decoding import units_from_run

    n_steps = 100
    events = synthetic_job(512, n_steps, seed=1)
    start = time.perf_counter()
    run = decode(events)
    steps = np.unique(run.event_step)
    units = units_from_run(run, steps, np.arange(len(steps)), len(steps), 512)
    counts = np.bincount(np.searchsorted(steps, run.event_step), minlength=len(steps))
    level = rollups.roll_steps(units, counts)
    t_steps = time.perf_counter() - start
    written = list(level)
    for finer, size in zip(rollups.LEVELS, rollups.LEVELS[1:], strict=False):
        per = size // finer
        level = [
            rollups.combine(size, b, [p for p in level if p.header.block // per == b])
            for b in sorted({p.header.block // per for p in level})
        ]
        written += level
    elapsed = time.perf_counter() - start
    assert len(written) == n_steps + 10 + 1 + 1 + 1, len(written)
    items = sum(len(b.sums) + 1 for b in written)
    by_level = ", ".join(f"{sum(b.header.size == s for b in written)} of {s:,}" for s in rollups.LEVELS)
    print(
        f"rolling up one range, 512 ranks x {n_steps} steps ({len(events)} events) after reading it: "
        f"{elapsed * 1e3:.0f} ms (decode and level-1 sums {t_steps * 1e3:.0f} ms, combines "
        f"{(elapsed - t_steps) * 1e3:.0f} ms); it writes {len(written)} blocks ({by_level}), {items} items"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-handler", action="store_true")
    parser.add_argument("--skip-long", action="store_true")
    args = parser.parse_args()
    bench_statistics(args.rounds)
    bench_decode_and_summarize(max(1, args.rounds // 2))
    if not args.skip_handler:
        bench_handler(1)
    if not args.skip_long:
        bench_long_statistics()
        bench_rollup_block()
        bench_long_run()


if __name__ == "__main__":
    main()
