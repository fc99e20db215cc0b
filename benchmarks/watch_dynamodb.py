"""The watch on DynamoDB (moto): items read and read units per watched run per round, for a 512-rank run
at step 1,000 and at step 100,000, side by side (issue 23's last figure).

    .venv/bin/python -m benchmarks.watch_dynamodb [--ranks 512] [--steps 1000 100000]

(about 8 minutes and 600 MB on 2 cores: moto answers a 33,000-item query in about 40 s.)

Each case is a fresh moto with the template's tables and the alerts queue. A run of ``--ranks`` ranks
logging two keys a step, a step a second, now at step S:

- the long past as the rollup function leaves it: blocks ``0 .. S/100 - 1`` written through the store's
  ``write_blocks`` and ``advance_rolled_through``, each a copy of one block rolled up by the real path
  (``decode``, ``units_from_run``, ``rollups.roll_block``) from 100 steps of real events (51,200 events
  cannot go through moto a million times over: 51M events at step 100,000);
- raw events only for the tail: the last ``TAIL_STEPS`` (64) steps the watch reads for the run's pace and
  the block being written (the items the ingest function would have put, written with
  ``BatchWriteItem``), and the run's record noted as ingest notes it.

Then three rounds of ``shared.watch.watch_round`` (the scheduled function's round), metered on the
boto3 client: every call, the items it returned and the read units DynamoDB would bill for it, from the
sizes of the items read by DynamoDB's rules (a query: the items' whole sizes summed per page, rounded up
to 4 KB, half for an eventually consistent read; a get: per item). moto's own ``ConsumedCapacity`` is a
constant per call whatever was read, so it is not used.

1. the first round (nothing watched yet: the tail read, a summary over the rollups and the tail);
2. a steady round of a live run: one more step from every rank arrived since (the usual round);
3. a round with nothing new (a stalled run: clock findings only, no summary).

Besides: the run item's size after the worst watch state the issue names (a run of 512 ranks, 511 of
them stopped while one goes on: every stopped rank a finding and an open alert), against DynamoDB's
400 KB item limit.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

ROLL_KEYS = ("train/loss", "optimizer/grad_norm")
PROJECT = "bench"


@dataclass
class Meter:
    """Counts what a boto3 client read, per operation."""

    calls: dict[str, int] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    rcu: dict[str, float] = field(default_factory=dict)
    writes: int = 0

    def add(self, op: str, items: int, rcu: float) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.items[op] = self.items.get(op, 0) + items
        self.rcu[op] = self.rcu.get(op, 0.0) + rcu

    def total(self) -> tuple[int, int, float]:
        return sum(self.calls.values()), sum(self.items.values()), sum(self.rcu.values())


def _full_size(item: dict[str, Any], request: dict[str, Any]) -> int:
    """An item's DynamoDB size, adding back what a projection left out of the answer: the partition key
    (the request names it) and, for events, the 16-byte digest ``h``; for rollups, ``n``."""
    from shared.store.dynamodb import PARTITION_KEY, item_size

    size = item_size(item)
    values = request.get("ExpressionAttributeValues", {})
    if "IndexName" not in request and request.get("TableName", "").endswith("metrics"):
        pk = values.get(":pk", {}).get("S", "")
        size += len(PARTITION_KEY) + len(pk.encode())
        size += 1 + 16 if "v" in item and "r" in item else 1 + 4
    return size


def metered(client: Any, meter: Meter) -> None:
    """Hook the client's calls: each answer's items and their read units."""

    def after(parsed: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        op = model.name
        request = context.get("meter_request", {})
        consistent = bool(request.get("ConsistentRead"))
        factor = 1.0 if consistent else 0.5
        if op == "Query":
            items = parsed.get("Items", [])
            size = sum(_full_size(item, request) for item in items)
            meter.add(
                _query_label(request),
                len(items),
                factor * max(1, math.ceil(size / 4096)),
            )
        elif op == "GetItem":
            item = parsed.get("Item")
            size = 0 if item is None else _full_size(item, request)
            meter.add(
                f"GetItem {_table(request)}", int(item is not None), factor * max(1, math.ceil(size / 4096))
            )
        elif op == "BatchGetItem":
            found = [i for items in parsed.get("Responses", {}).values() for i in items]
            rcu = sum(factor * max(1, math.ceil(_full_size(i, request) / 4096)) for i in found)
            meter.add("BatchGetItem", len(found), rcu)
        elif op in ("UpdateItem", "PutItem", "DeleteItem", "BatchWriteItem"):
            meter.writes += 1

    def keep_request(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["meter_request"] = dict(params)

    events = client.meta.events
    events.register("provide-client-params.dynamodb.*", keep_request)
    events.register("after-call.dynamodb.*", after)


def _query_label(request: dict[str, Any]) -> str:
    """What a query read: the runs index, events, rollup headers or rollup sums."""
    if request.get("IndexName"):
        return f"Query {request['IndexName']}"
    pk = request.get("ExpressionAttributeValues", {}).get(":pk", {}).get("S", "")
    if pk.startswith("@rollup#"):
        return "Query rollup sums" if pk.count("#") > 2 else "Query rollup headers"
    return "Query events" if pk else f"Query {_table(request)}"


def _table(request: dict[str, Any]) -> str:
    name = str(request.get("TableName", ""))
    return name.removeprefix("bench-")


@contextlib.contextmanager
def moto_tables() -> Iterator[dict[str, str]]:
    """The template's tables and queues in moto, named ``bench-*``; yields the names."""
    import boto3
    from moto import mock_aws

    from infra import template

    # moto only: fake credentials and a region, never an endpoint of a real account
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ[name] = value
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        os.environ.pop(name, None)
    refs = {name: f"bench-{name.removesuffix('Table').lower()}" for name in template.tables()}
    with mock_aws():
        for logical_id, name in refs.items():
            boto3.client("dynamodb").create_table(TableName=name, **template.table_definition(logical_id))
        for logical_id in template.queues():
            refs[logical_id] = boto3.client("sqs").create_queue(QueueName=f"bench-{logical_id.lower()}")[
                "QueueUrl"
            ]
        yield refs


def one_block(ranks: int) -> Any:
    """One block of ``ranks`` x 100 steps rolled up by the real path (its events never stored)."""
    from shared import rollups
    from shared.decoding import decode, units_from_run
    from shared.store.port import StoredEvent

    rng = np.random.default_rng(0)
    keys = list(ROLL_KEYS)
    events = []
    for step in range(rollups.BLOCK_STEPS):
        for rank in range(ranks):
            values = (2.0 - step / 1000 + rng.normal(0, 0.01), 3.0 + rng.normal(0, 0.1))
            packed = np.array([1.0, 1e9 + step, *values], "<f8").tobytes()
            events.append(StoredEvent(f"e{step}-{rank}", step, rank, ranks, keys, packed, rank % 8))
    run = decode(events)
    steps = np.unique(run.event_step)
    units = units_from_run(run, steps, np.zeros(len(steps), np.int64), 1, ranks)
    rolled = rollups.roll_block(0, units, len(events))
    assert rolled is not None
    return rolled


def raw_events(run_id: str, ranks: int, steps: range, now: float, last: int) -> list[Any]:
    from shared.models import RankEvent

    rng = np.random.default_rng(1)
    out = []
    for step in steps:
        for rank in range(ranks):
            values = (2.0 - step / 1e6 + float(rng.normal(0, 0.01)), 3.0 + float(rng.normal(0, 0.1)))
            t = now - (last - step) - 1.0 + rank / 1e4  # a step a second, the last one a second ago
            out.append(
                RankEvent(
                    PROJECT,
                    run_id,
                    f"e{step}-{rank}",
                    step,
                    rank,
                    ranks,
                    rank % 8,
                    1.0,
                    t,
                    ROLL_KEYS,
                    values,
                    b"\0" * 16,
                )
            )
    return out


def write_raw(store: Any, events: list[Any]) -> None:
    """The items the ingest function puts, written 25 a call (no conditional put: the benchmark's set-up)."""
    from shared.store.dynamodb import item_of

    items = [{"PutRequest": {"Item": item_of(e)}} for e in events]
    for i in range(0, len(items), 25):
        store.client.batch_write_item(RequestItems={store.table_name: items[i : i + 25]})


def note(store: Any, run_id: str, events: list[Any], now: float) -> None:
    from shared.runs import activity

    store.note_activity(PROJECT, run_id, activity(events, now))


@dataclass
class Case:
    steps: int
    rounds: list[tuple[str, Meter, float, dict[str, Any]]]
    blocks: int
    tail_events: int
    item_bytes: int


def run_case(ranks: int, last: int, template_block: Any) -> Case:
    from shared import rollups
    from shared.store.dynamodb import DynamoStore, item_size
    from shared.watch import round_json, watch_round

    with moto_tables() as refs:
        store = DynamoStore(
            refs["MetricsTable"],
            runs_table=refs["RunsTable"],
            alerts_table=refs["AlertsTable"],
            alerts_queue=refs["AlertsQueue"],
        )
        run_id = f"run-{last}"
        now = time.time()
        rolled_through = last // rollups.BLOCK_STEPS - 1  # the block being written is not rolled up
        h = template_block.header
        blocks = []
        for b in range(rolled_through + 1):
            first = b * rollups.BLOCK_STEPS
            header = replace(h, block=b, first_step=first, last_step=first + rollups.BLOCK_STEPS - 1)
            blocks.append(replace(template_block, header=header))
        for i in range(0, len(blocks), 200):
            store.write_blocks(PROJECT, run_id, blocks[i : i + 200])
        store.advance_rolled_through(PROJECT, run_id, rolled_through)
        from shared.watch import TAIL_STEPS

        first_raw = min(last - TAIL_STEPS, (rolled_through + 1) * rollups.BLOCK_STEPS)
        tail = raw_events(run_id, ranks, range(max(0, first_raw), last + 1), now, last)
        write_raw(store, tail)
        for step in range(max(0, first_raw), last + 1):  # the record as ingest notes it, a step at a time
            note(store, run_id, [e for e in tail if e.step == step], now)

        meter = Meter()
        metered(store.client, meter)
        rounds = []
        for name, more in (("first round", False), ("steady round", True), ("nothing new", False)):
            if more:  # a step later: one more step from every rank, noted as ingest notes it
                now += 1.0
                last += 1
                new = raw_events(run_id, ranks, range(last, last + 1), now, last)
                write_raw(store, new)
                note(store, run_id, new, now)
            meter.calls.clear(), meter.items.clear(), meter.rcu.clear()
            meter.writes = 0
            report = watch_round(store, now=now + 0.5)
            assert not report.failed, report.failed
            rounds.append(
                (
                    name,
                    replace(meter, calls=dict(meter.calls), items=dict(meter.items), rcu=dict(meter.rcu)),
                    report.seconds,
                    round_json(report),
                )
            )
        item = store.client.get_item(
            TableName=store.runs_table, Key={"project": {"S": PROJECT}, "run_id": {"S": run_id}}
        )["Item"]
        return Case(last - 1, rounds, len(blocks), len(tail), item_size(item))


def worst_state(ranks: int) -> tuple[int, int, int, int, int]:
    """A run of ``ranks`` ranks, all but rank 0 stopped at step 9 while rank 0 went on to step 60: the
    run item's size after a round (bytes), the state's JSON and stored (compressed) sizes, the findings
    and open alerts it keeps."""
    from shared.store.dynamodb import DynamoStore, item_size
    from shared.watch import WatchState, watch_round

    with moto_tables() as refs:
        store = DynamoStore(
            refs["MetricsTable"],
            runs_table=refs["RunsTable"],
            alerts_table=refs["AlertsTable"],
            alerts_queue=refs["AlertsQueue"],
        )
        now = time.time()
        events = raw_events("worst", ranks, range(0, 10), now - 50, 9)
        events += [e for e in raw_events("worst", ranks, range(10, 61), now, 60) if e.rank == 0]
        write_raw(store, events)
        for step in range(61):
            note(store, "worst", [e for e in events if e.step == step], now)
        report = watch_round(store, now=now + 1)
        assert not report.failed, report.failed
        item = store.client.get_item(
            TableName=store.runs_table, Key={"project": {"S": PROJECT}, "run_id": {"S": "worst"}}
        )["Item"]
        record = store.get_run(PROJECT, "worst")
        assert record is not None and record.watch is not None
        state = WatchState.from_json(record.watch)
        return (
            item_size(item),
            len(record.watch.encode()),
            len(item["watch"]["B"]),
            len(state.summary_findings),
            len(state.open),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 100_000])
    args = parser.parse_args()
    started = time.perf_counter()
    template_block = one_block(args.ranks)
    cases = [run_case(args.ranks, steps, template_block) for steps in args.steps]

    print(f"watch rounds on DynamoDB (moto), one run of {args.ranks} ranks x 2 keys, a step a second")
    print("read units as DynamoDB bills them (from item sizes; moto's ConsumedCapacity is a constant)\n")
    head = f"{'':34}" + "".join(f"{'step ' + format(c.steps, ','):>30}" for c in cases)
    print(head)
    print(
        f"{'rolled blocks / raw tail events':34}"
        + "".join(f"{f'{c.blocks:,} / {c.tail_events:,}':>30}" for c in cases)
    )
    for i, (name, *_rest) in enumerate(cases[0].rounds):
        print(f"\n{name}:")
        ops = sorted({op for c in cases for op in c.rounds[i][1].calls})
        for op in ops:
            cells = []
            for c in cases:
                m = c.rounds[i][1]
                cells.append(
                    f"{m.calls.get(op, 0)} calls {m.items.get(op, 0):,} it {m.rcu.get(op, 0.0):,.1f} RCU"
                )
            print(f"  {op:32}" + "".join(f"{cell:>30}" for cell in cells))
        cells = []
        for c in cases:
            _, items, rcu = c.rounds[i][1].total()
            cells.append(f"{items:,} items {rcu:,.1f} RCU")
        print(f"  {'per watched run, total':32}" + "".join(f"{cell:>30}" for cell in cells))
        print(f"  {'round time (moto, in-process)':32}" + "".join(f"{c.rounds[i][2]:>29.2f}s" for c in cases))
        print(
            f"  {'summarized / deliveries':32}"
            + "".join(f"{c.rounds[i][3]['summarized']:>26} / {c.rounds[i][3]['deliveries']}" for c in cases)
        )
    print(f"\n{'run item after the rounds (bytes)':34}" + "".join(f"{c.item_bytes:>30,}" for c in cases))
    size, state_json, stored, findings, open_alerts = worst_state(args.ranks)
    print(
        f"\nworst state ({args.ranks} ranks, {args.ranks - 1} stopped while one goes on): "
        f"{findings} findings and {open_alerts} open alerts kept; state {state_json:,} bytes of JSON, "
        f"{stored:,} stored compressed; run item {size:,} bytes (DynamoDB's limit: 400 KB)"
    )
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
