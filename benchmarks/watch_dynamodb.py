"""The watch on DynamoDB (moto): items read and read units per watched run per round, for a 512-rank run
at step 1,000 and at step 100,000, side by side (issue 23's last figure).

    .venv/bin/python -m benchmarks.watch_dynamodb [--ranks 512] [--steps 1000 100000] [--quick]

(``--quick``: 64 ranks. Most of the time is moto writing the set-up's items, a few hundred a second.)

Each case is a fresh moto with the template's tables and the alerts queue. A run of ``--ranks`` ranks
logging two keys a step, a step a second, now at step S:

- the long past as the rollup function leaves it: the levels of rollups (``rollups.LEVELS``: blocks of
  1, 10, 100, 1,000 and 10,000 steps) up to its progress mark ``S - SETTLE_STEPS``, written through the
  store's ``write_blocks`` and ``advance_rollups``. 100 steps of real events go through the real path
  once (``decode``, ``units_from_run``, ``rollups.roll_steps`` for the level-1 blocks, ``rollups.combine``
  for the level-10 and level-100 ones), and every block of those levels is a copy of one of them moved to
  its steps (51M events cannot go through moto: 512 ranks at step 100,000); the levels 1,000 and 10,000,
  and every block the mark cuts (holding only the steps up to it, as ``shared.summary.rolling`` writes it),
  are combined from the blocks below them. The levels 100 to 10,000 cover the whole run; the levels 1 and 10
  only the steps from the watch window's first step on (``shared.watch.rounds.window``: the last
  ``WINDOW_STEPS``, from a multiple of ``WINDOW_ALIGN``): a summary reads a level's blocks by a range
  of block numbers, so the blocks before its window are never read (at step 100,000 they would be
  110,000 more blocks to write through moto);
- raw events only where a round reads them: the steps after the mark and the last ``TAIL_STEPS`` (32)
  the watch reads for the run's pace, plus the window's first step (the summary looks for the first step
  of its window among the events: one item a shard, as with every step stored) (the items the ingest
  function would have put, written with ``BatchWriteItem``), and the run's record noted for the tail's
  steps as ingest notes it.

Then three rounds of ``shared.watch.rounds.watch_round`` (the scheduled function's round), metered on the
boto3 client: every call, the items it returned and the read units DynamoDB would bill for it, from the
sizes of the items read by DynamoDB's rules (a query: the items' whole sizes summed per page, rounded up
to 4 KB, half for an eventually consistent read; a get: per item). moto's own ``ConsumedCapacity`` is a
constant per call whatever was read, so it is not used.

1. the first round (nothing watched yet: the tail read, a summary over the levels and the steps after
   the mark);
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


def template_levels(ranks: int) -> tuple[dict[int, list[Any]], bytes]:
    """Steps 0 to 99 of ``ranks`` ranks rolled up by the real path (their events never stored): the
    level-1 blocks (``rollups.roll_steps``) and the level-10 and level-100 ones combined from them; and
    the ranks' nodes as the progress mark records them."""
    from shared import rollups
    from shared.store.port import StoredEvent
    from shared.summary.decoding import decode, units_from_run

    rng = np.random.default_rng(0)
    keys = list(ROLL_KEYS)
    events = []
    for step in range(100):
        for rank in range(ranks):
            values = (2.0 - step / 1000 + rng.normal(0, 0.01), 3.0 + rng.normal(0, 0.1))
            packed = np.array([1.0, 1e9 + step, *values], "<f8").tobytes()
            events.append(StoredEvent(f"e{step}-{rank}", step, rank, ranks, keys, packed, rank % 8))
    run = decode(events)
    steps = np.unique(run.event_step)
    units = units_from_run(run, steps, np.arange(len(steps)), len(steps), ranks)
    counts = np.bincount(np.searchsorted(steps, run.event_step), minlength=len(steps))
    level1 = rollups.roll_steps(units, counts)
    level10 = [rollups.combine(10, b, level1[b * 10 : b * 10 + 10]) for b in range(10)]
    level100 = [rollups.combine(100, 0, level10)]
    return {1: level1, 10: level10, 100: level100}, units.node_start.astype("<i4").tobytes()


def moved(rolled: Any, number: int) -> Any:
    """A rolled block as block ``number`` of its level: the same sums, its steps moved."""
    h = rolled.header
    d = (number - h.block) * h.size
    header = replace(
        h,
        block=number,
        first_step=h.first_step + d,
        last_step=h.last_step + d,
        first=np.where(h.first >= 0, h.first + d, -1),
        last=np.where(h.last >= 0, h.last + d, -1),
    )
    return replace(rolled, header=header)


class Levels:
    """The blocks of a run whose every 100 steps are the template's, as the rollup function leaves them
    with its progress mark at ``mark``."""

    def __init__(self, template: dict[int, list[Any]], mark: int) -> None:
        self.template, self.mark = template, mark
        self._whole: dict[int, Any] = {}

    def block(self, size: int, number: int) -> Any | None:
        """Block ``number`` of level ``size``: its steps up to the mark, None if it has none."""
        from shared import rollups

        first = number * size
        if first > self.mark:
            return None
        if first + size - 1 <= self.mark:
            return self.whole(size, number)
        parts = [self.block(size // 10, c) for c in range(number * 10, number * 10 + 10)]
        return rollups.combine(size, number, [p for p in parts if p is not None])

    def whole(self, size: int, number: int) -> Any:
        from shared import rollups

        if size in self.template:
            return moved(self.template[size][number % len(self.template[size])], number)
        if size not in self._whole:
            self._whole[size] = rollups.combine(size, 0, [self.whole(size // 10, c) for c in range(10)])
        return moved(self._whole[size], number)

    def blocks(self, size: int, from_step: int) -> list[Any]:
        """The level's blocks from the one holding ``from_step`` to the one holding the mark."""
        return [self.block(size, b) for b in range(from_step // size, self.mark // size + 1)]


def raw_events(run_id: str, ranks: int, steps: range, now: float, last: int) -> list[Any]:
    from shared.events import RankEvent

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
    from shared.ingest.activity import activity

    store.note_activity(PROJECT, run_id, activity(events, now))


@dataclass
class Case:
    steps: int
    rounds: list[tuple[str, Meter, float, dict[str, Any]]]
    blocks: int
    tail_events: int
    item_bytes: int


def run_case(ranks: int, last: int, template: dict[int, list[Any]], nodes: bytes) -> Case:
    from shared import rollups
    from shared.store.dynamodb import DynamoStore, item_size
    from shared.summary.rolling import SETTLE_STEPS
    from shared.watch.rounds import TAIL_STEPS, round_json, watch_round, window

    with moto_tables() as refs:
        store = DynamoStore(
            refs["MetricsTable"],
            runs_table=refs["RunsTable"],
            alerts_table=refs["AlertsTable"],
            alerts_queue=refs["AlertsQueue"],
        )
        run_id = f"run-{last}"
        now = time.time()
        mark = last - SETTLE_STEPS  # the newest steps are not rolled up yet
        # The window's first step, this round and the next (one step later).
        window_first = min(int(window(s, False, None).get("step_min", 0)) for s in (last, last + 1))
        levels = Levels(template, mark)
        blocks = [
            block
            for size in rollups.LEVELS
            for block in levels.blocks(size, window_first if size < 100 else 0)
        ]
        for i in range(0, len(blocks), 200):
            store.write_blocks(PROJECT, run_id, blocks[i : i + 200])
        store.advance_rollups(PROJECT, run_id, mark, nodes)

        first_raw = max(0, min(last - TAIL_STEPS, mark + 1))
        tail = raw_events(run_id, ranks, range(first_raw, last + 1), now, last)
        write_raw(store, tail)
        n_raw = len(tail)
        if window_first < first_raw:  # where the window starts (read by next_step only)
            start = raw_events(run_id, ranks, range(window_first, window_first + 1), now, last)
            write_raw(store, start)
            n_raw += len(start)
        for step in range(first_raw, last + 1):  # the record as ingest notes it, a step at a time
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
            meter.calls.clear()
            meter.items.clear()
            meter.rcu.clear()
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
        return Case(last - 1, rounds, len(blocks), n_raw, item_size(item))


def worst_state(ranks: int) -> tuple[int, int, int, int, int]:
    """A run of ``ranks`` ranks, all but rank 0 stopped at step 9 while rank 0 went on to step 60: the
    run item's size after a round (bytes), the state's JSON and stored (compressed) sizes, the findings
    and open alerts it keeps."""
    from shared.store.dynamodb import DynamoStore, item_size
    from shared.watch.rounds import WatchState, watch_round

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
    parser.add_argument("--quick", action="store_true", help="64 ranks (a shorter set-up)")
    args = parser.parse_args()
    if args.quick:
        args.ranks = 64
    started = time.perf_counter()
    template, nodes = template_levels(args.ranks)
    cases = [run_case(args.ranks, steps, template, nodes) for steps in args.steps]

    print(f"watch rounds on DynamoDB (moto), one run of {args.ranks} ranks x 2 keys, a step a second")
    print("read units as DynamoDB bills them (from item sizes; moto's ConsumedCapacity is a constant)\n")
    head = f"{'':34}" + "".join(f"{'step ' + format(c.steps, ','):>30}" for c in cases)
    print(head)
    print(
        f"{'rolled blocks / raw events':34}"
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
