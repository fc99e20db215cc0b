"""The metering of ``benchmarks/aws_model.py`` held to DynamoDB's documented billing rules.

Each rule is stated on one of these pages (checked 2026-12):

- item sizes: https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/CapacityUnitCalculations.html
- read and write units: https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/read-write-operations.html
  ("the larger of the two" item sizes for a put or update; BatchGetItem rounds each item up to 4 KB,
  its example: 1.5 KB and 6.5 KB items read as 12 KB; a Query sums the items it read, then rounds)
- failed conditional writes: https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/Expressions.ConditionExpressions.html
  (billed on the existing item's size, at least 1 unit)
- index writes: https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/GSI.html#GSI.ThroughputConsiderations.Writes
  (a new indexed item: 1 put; an index key changed: a delete and a put; only projected attributes
  changed: 1 write; out of the index before and after: nothing)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.metering import (
    Index,
    Meter,
    Table,
    item_size,
    moto_item_reader,
    read_units,
    write_cost,
    write_units,
)

RUNS = Table(
    "runs",
    ("project", "run_id"),
    (Index("by_activity", ("project", "last_event"), "INCLUDE", frozenset({"created", "finished"})),),
)


def s(text: str) -> dict[str, str]:
    return {"S": text}


def n(number: str) -> dict[str, str]:
    return {"N": number}


def test_item_sizes_follow_the_documented_rules() -> None:
    assert item_size({"name": s("héllo")}) == 4 + 6  # UTF-8 bytes of the name and of the string
    assert item_size({"v": {"B": b"\0" * 100}}) == 1 + 100  # raw bytes, not base64
    assert item_size({"v": {"B": "AAAA"}}) == 1 + 3  # (moto keeps binaries base64-encoded)
    # numbers: 1 byte per two significant digits (leading and trailing zeros trimmed) plus 1
    assert item_size({"x": n("1")}) == 1 + 2
    assert item_size({"x": n("12345")}) == 1 + 4
    assert item_size({"x": n("0.001200")}) == 1 + 2  # "12"
    assert item_size({"x": n("-1.5e10")}) == 1 + 2
    assert item_size({"ok": {"BOOL": True}, "no": {"NULL": True}}) == (2 + 1) + (2 + 1)
    assert item_size({"r": {"NS": ["1", "22", "333"]}}) == 1 + 2 + 2 + 3
    assert item_size({"l": {"L": [s("ab"), n("1")]}}) == 1 + 3 + (1 + 2) + (1 + 2)  # 3 + 1 per element
    assert item_size({"m": {"M": {"k": s("v")}}}) == 1 + 3 + (1 + 1 + 1)
    assert item_size(None) == 0


def test_write_units_are_the_larger_item_per_started_kb_and_a_failed_condition_is_billed() -> None:
    small = {"project": s("p"), "run_id": s("r"), "blob": {"B": b"x" * 900}}
    big = {**small, "blob": {"B": b"x" * 5000}}
    assert write_units(1) == 1
    assert write_units(1024) == 1
    assert write_units(1025) == 2
    assert write_cost(Table("t", ("project", "run_id")), small, big, True).table == 5  # grows: the new size
    assert write_cost(Table("t", ("project", "run_id")), big, small, True).table == 5  # shrinks: the old one
    assert write_cost(Table("t", ("project", "run_id")), None, small, True).table == 1
    # A condition that failed: the item as it was, at least 1 unit (none there: 1).
    assert write_cost(Table("t", ("project", "run_id")), big, big, False).table == 5
    assert write_cost(Table("t", ("project", "run_id")), None, None, False).table == 1


def test_index_writes_follow_the_documented_cases() -> None:
    base = {"project": s("p"), "run_id": s("r"), "created": n("1")}
    entered = {**base, "last_event": n("10")}
    assert write_cost(RUNS, base, base, True).indexes == {}  # in no index before or after
    assert write_cost(RUNS, base, entered, True).indexes == {"by_activity": 1}  # a put
    assert write_cost(RUNS, entered, base, True).indexes == {"by_activity": 1}  # a delete
    moved = {**entered, "last_event": n("11")}
    assert write_cost(RUNS, entered, moved, True).indexes == {"by_activity": 2}  # key changed: both
    finished = {**entered, "finished": n("12")}
    assert write_cost(RUNS, entered, finished, True).indexes == {"by_activity": 1}  # projected: one
    unprojected = {**entered, "config": s("x" * 3000)}
    assert write_cost(RUNS, entered, unprojected, True).indexes == {}  # not in the entry: nothing
    assert write_cost(RUNS, entered, unprojected, True).table == 3  # but the table's write is the item's
    assert write_cost(RUNS, entered, moved, False).indexes == {}  # a failed condition writes no index


def test_read_units_round_up_to_4_kb_and_halve_when_eventually_consistent() -> None:
    assert read_units(3500, True) == 1
    assert read_units(3500, False) == 0.5
    assert read_units(10 * 1024, True) == 3  # "a 10 KB item ... rounded up to 12 KB"
    assert read_units(0, True) == 1  # nothing found still costs the minimum


@pytest.fixture
def metered(metrics_table: str) -> Iterator[tuple[Meter, Any]]:
    """moto with the template's tables, and a meter on every client made from here on."""
    import boto3

    from infra import template

    tables = {
        f"test-{name.removesuffix('Table').lower()}": Table.from_definition(
            f"test-{name.removesuffix('Table').lower()}", template.table_definition(name)
        )
        for name in template.tables()
    }
    boto3.setup_default_session()
    meter = Meter(tables, moto_item_reader())
    meter.attach()
    yield meter, boto3.client("dynamodb")
    meter.detach()


def test_the_meter_bills_calls_on_moto_as_dynamodb_would(metered: tuple[Meter, Any]) -> None:
    meter, client = metered
    key = {"project": s("p"), "run_id": s("r")}
    client.update_item(
        TableName="test-runs",
        Key=key,
        UpdateExpression="SET last_event = :t, created = :t, config = :c",
        ExpressionAttributeValues={":t": n("10"), ":c": s("x" * 1500)},
    )
    bill = meter.take()
    assert bill.wcu["test-runs"] == 2  # the new item: 1.5 KB and a little
    assert bill.wcu["test-runs/by_activity"] == 1  # it entered the index (its entry is small)
    assert bill.wcu["test-runs/by_received"] == 0  # it has no watch_shard: not in that index

    from botocore.exceptions import ClientError

    with pytest.raises(ClientError):  # a condition that fails is billed on the item as it is
        client.update_item(
            TableName="test-runs",
            Key=key,
            UpdateExpression="SET last_event = :t",
            ConditionExpression="last_event < :t",
            ExpressionAttributeValues={":t": n("5")},
        )
    bill = meter.take()
    assert (bill.wcu["test-runs"], bill.failed_conditions, bill.wcu["test-runs/by_activity"]) == (2, 1, 0)

    client.update_item(
        TableName="test-runs",
        Key=key,
        UpdateExpression="REMOVE config SET last_event = :t",
        ExpressionAttributeValues={":t": n("11")},
    )
    bill = meter.take()
    assert bill.wcu["test-runs"] == 2  # the larger: the item before
    assert bill.wcu["test-runs/by_activity"] == 2  # its index key changed: a delete and a put
    assert bill.item_wcu[("test-runs", ("p", "r"))] == 2

    # Reads are billed on whole items, whatever the projection: 5 items of about 3 KB, one query.
    for i in range(5):
        client.put_item(TableName="test-runs", Item={**key, "run_id": s(f"q{i}"), "pad": s("y" * 3000)})
    meter.take()
    answer = client.query(
        TableName="test-runs",
        KeyConditionExpression="#p = :p AND begins_with(#r, :q)",
        ExpressionAttributeNames={"#p": "project", "#r": "run_id"},
        ExpressionAttributeValues={":p": s("p"), ":q": s("q")},
        ProjectionExpression="#r",
    )
    assert len(answer["Items"]) == 5
    bill = meter.take()
    assert bill.rcu["test-runs"] == 0.5 * 4  # about 15 KB summed, rounded up to 16 KB, eventually consistent
    client.get_item(TableName="test-runs", Key={**key, "run_id": s("q0")}, ConsistentRead=True)
    assert meter.take().rcu["test-runs"] == 1.0

    # BatchGetItem rounds each item: the page's example, 1.5 KB and 6.5 KB read as 4 + 8 KB.
    for name, size in (("b1", 1536 - 40), ("b2", 6656 - 40)):
        client.put_item(TableName="test-runs", Item={**key, "run_id": s(name), "pad": s("z" * size)})
    meter.take()
    client.batch_get_item(
        RequestItems={
            "test-runs": {
                "Keys": [{**key, "run_id": s("b1")}, {**key, "run_id": s("b2")}],
                "ConsistentRead": True,
            }
        }
    )
    assert meter.take().rcu["test-runs"] == 3.0
