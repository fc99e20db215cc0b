"""DynamoDB's bill read off boto3 clients: capacity units per call by DynamoDB's documented rules.

moto's ``ConsumedCapacity`` is a constant per call whatever was read or written, so it is not used;
this meter computes what DynamoDB would bill from the items themselves (``tests/unit/test_metering.py``
holds it to the rules, each with the page that states it):

- an item's size: its attribute names and values (strings and binaries by their bytes, a number by one
  byte per two significant digits plus one, sets and lists by their elements, a list or map 3 bytes and
  1 per element more, a null or boolean 1 byte);
- a write (``PutItem``, ``UpdateItem``, ``DeleteItem``, each put or delete of ``BatchWriteItem``): one
  write unit per started KB of the larger of the item before and after it; a write whose condition
  failed is billed too, on the item as it was (at least 1 unit);
- a global secondary index: an item that enters it costs a put of its index entry, one that leaves it a
  delete, a change of its index keys both, a change of projected attributes only one write of the entry
  (per started KB of the entry: the table's and the index's keys and the projected attributes); a write
  that leaves the entry as it was costs the index nothing;
- a read: ``GetItem`` one unit per started 4 KB of the item (at least 1), ``BatchGetItem`` the same per
  item, ``Query`` per started 4 KB of the sizes of every item it read (before any filter or projection:
  the whole items, or index entries) summed per call, at least 1; eventually consistent reads half.

The meter hooks the default boto3 session, so every client made after ``attach`` is metered (the
functions make theirs lazily). It reads items before and after each write straight from moto's backend
(no call, no bill), and counts the CPU time of moto's own work and of its own hooks apart, so that a
handler's CPU time can be told from the fake server's (``excluded_cpu``).
"""

from __future__ import annotations

import base64
import math
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

KB = 1024
READ_UNIT_BYTES = 4 * KB
WRITES = ("PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem")
READS = ("GetItem", "BatchGetItem", "Query", "Scan")


# --- sizes and units ------------------------------------------------------------------------------


def _number_size(text: str) -> int:
    """A number's size: 1 byte per two significant digits (leading and trailing zeros trimmed), plus 1."""
    mantissa = str(Decimal(text).normalize()).lstrip("-")
    mantissa, _, _ = mantissa.partition("E")
    digits = mantissa.replace(".", "").lstrip("0") or "0"
    return -(-len(digits) // 2) + 1


def _binary_size(value: bytes | str) -> int:
    """Raw bytes (boto3 hands bytes; moto keeps them base64-encoded)."""
    return len(value) if isinstance(value, (bytes, bytearray)) else len(base64.b64decode(value))


def value_size(value: dict[str, Any]) -> int:
    """The size of one attribute value (DynamoDB's wire form: ``{"S": ...}``, ``{"N": ...}``, ...)."""
    ((kind, data),) = value.items()
    if kind == "S":
        return len(data.encode("utf-8", "surrogatepass"))
    if kind == "N":
        return _number_size(data)
    if kind == "B":
        return _binary_size(data)
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "SS":
        return sum(len(s.encode("utf-8", "surrogatepass")) for s in data)
    if kind == "NS":
        return sum(_number_size(n) for n in data)
    if kind == "BS":
        return sum(_binary_size(b) for b in data)
    if kind == "L":
        return 3 + sum(1 + value_size(element) for element in data)
    if kind == "M":
        return 3 + sum(1 + len(name.encode()) + value_size(element) for name, element in data.items())
    raise ValueError(f"unknown attribute type {kind!r}")


def item_size(item: dict[str, Any] | None) -> int:
    """An item's size: the sum of its attribute names' UTF-8 bytes and its values' sizes (0: no item)."""
    if not item:
        return 0
    return sum(len(name.encode("utf-8", "surrogatepass")) + value_size(value) for name, value in item.items())


def write_units(size: int) -> int:
    """Write units of one write whose billed size is ``size`` bytes: one per started KB, at least 1."""
    return max(1, math.ceil(size / KB))


def read_units(size: int, consistent: bool) -> float:
    """Read units of one read of ``size`` bytes: one per started 4 KB (at least 1), half when eventually
    consistent."""
    return max(1, math.ceil(size / READ_UNIT_BYTES)) * (1.0 if consistent else 0.5)


# --- tables and indexes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Index:
    name: str
    keys: tuple[str, ...]  # hash (and range) key of the index
    projection: str  # ALL, KEYS_ONLY or INCLUDE
    attributes: frozenset[str] = frozenset()  # INCLUDE's non-key attributes


@dataclass(frozen=True)
class Table:
    name: str
    keys: tuple[str, ...]  # hash (and range) key of the table
    indexes: tuple[Index, ...] = ()

    @classmethod
    def from_definition(cls, name: str, definition: dict[str, Any]) -> Table:
        """From a ``create_table`` definition (``infra.template.table_definition``)."""

        def keys(schema: list[dict[str, str]]) -> tuple[str, ...]:
            ordered = sorted(schema, key=lambda k: k["KeyType"] != "HASH")
            return tuple(k["AttributeName"] for k in ordered)

        indexes = tuple(
            Index(
                gsi["IndexName"],
                keys(gsi["KeySchema"]),
                gsi["Projection"]["ProjectionType"],
                frozenset(gsi["Projection"].get("NonKeyAttributes", ())),
            )
            for gsi in definition.get("GlobalSecondaryIndexes", [])
        )
        return cls(name, keys(definition["KeySchema"]), indexes)

    def key_of(self, item: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(_plain(item[name]) for name in self.keys)

    def entry(self, item: dict[str, Any] | None, index: Index) -> dict[str, Any] | None:
        """The item's entry in ``index`` (None when it lacks an index key: not in the index)."""
        if not item or any(name not in item for name in index.keys):
            return None
        if index.projection == "ALL":
            return dict(item)
        wanted = set(self.keys) | set(index.keys)
        if index.projection == "INCLUDE":
            wanted |= index.attributes
        return {name: value for name, value in item.items() if name in wanted}


def _plain(value: dict[str, Any]) -> Any:
    ((_, data),) = value.items()
    return data.decode("latin-1") if isinstance(data, bytes) else data


@dataclass
class WriteCost:
    table: int  # write units on the table
    indexes: dict[str, int]  # write units per index


def write_cost(
    table: Table, before: dict[str, Any] | None, after: dict[str, Any] | None, applied: bool
) -> WriteCost:
    """What one write costs: the larger of the item before and after (a failed condition: the item as it
    was, at least 1), and each index's writes by the rules of this module's docstring."""
    if not applied:
        return WriteCost(write_units(item_size(before)), {})
    indexes: dict[str, int] = {}
    for index in table.indexes:
        old, new = table.entry(before, index), table.entry(after, index)
        if old is None and new is None:
            continue
        if old is None:
            units = write_units(item_size(new))
        elif new is None:
            units = write_units(item_size(old))
        elif any(_plain(old[k]) != _plain(new[k]) for k in index.keys):
            units = write_units(item_size(old)) + write_units(item_size(new))
        elif _same(old, new):
            continue
        else:
            units = write_units(max(item_size(old), item_size(new)))
        indexes[index.name] = units
    return WriteCost(write_units(max(item_size(before), item_size(after))), indexes)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_canonical(a[k]) == _canonical(b[k]) for k in a)


def _canonical(value: dict[str, Any]) -> Any:
    ((kind, data),) = value.items()
    if kind == "B" and isinstance(data, str):
        return kind, base64.b64decode(data)
    if kind in ("NS", "SS", "BS"):
        return kind, frozenset(_canonical({kind[0]: d})[1] for d in data)
    if kind == "N":
        return kind, Decimal(data)
    return kind, repr(data)


# --- the meter ------------------------------------------------------------------------------------


@dataclass
class Bill:
    """What the metered calls cost, by operation, item, partition and index."""

    calls: Counter[str] = field(default_factory=Counter)
    wcu: Counter[str] = field(default_factory=Counter)  # by table or "table/index"
    rcu: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    items_read: Counter[str] = field(default_factory=Counter)
    failed_conditions: int = 0
    #: write units per item (table, key) and per partition (table or index, partition key value)
    item_wcu: Counter[tuple[str, tuple[Any, ...]]] = field(default_factory=Counter)
    partition_wcu: Counter[tuple[str, Any]] = field(default_factory=Counter)
    partition_rcu: defaultdict[tuple[str, Any], float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total_wcu(self) -> int:
        return sum(self.wcu.values())

    @property
    def total_rcu(self) -> float:
        return sum(self.rcu.values())

    def copy(self) -> Bill:
        out = Bill()
        out.add(self)
        return out

    def add(self, other: Bill) -> None:
        self.calls.update(other.calls)
        self.wcu.update(other.wcu)
        for k, v in other.rcu.items():
            self.rcu[k] += v
        self.items_read.update(other.items_read)
        self.failed_conditions += other.failed_conditions
        self.item_wcu.update(other.item_wcu)
        self.partition_wcu.update(other.partition_wcu)
        for k2, v in other.partition_rcu.items():
            self.partition_rcu[k2] += v


class Meter:
    """Meters every DynamoDB call of the clients made after ``attach`` (see the module's docstring).

    ``read_item(table, key)`` returns an item as stored (wire form) without a call of its own: the model
    passes one that reads moto's backend."""

    def __init__(
        self, tables: dict[str, Table], read_item: Callable[[str, dict[str, Any]], dict[str, Any] | None]
    ):
        self.tables = tables
        self.read_item = read_item
        self.bill = Bill()
        self._lock = threading.Lock()
        self._local = threading.local()
        #: CPU seconds of the meter's hooks and of moto's own work, in every thread (not the client's).
        self.excluded_cpu = 0.0

    # The hooks -----------------------------------------------------------------------------------

    def attach(self) -> None:
        """Meter every client the default boto3 session makes from now on, and count moto's CPU apart."""
        import boto3

        if boto3.DEFAULT_SESSION is None:
            boto3.setup_default_session()
        assert boto3.DEFAULT_SESSION is not None
        events = boto3.DEFAULT_SESSION.events
        events.register("provide-client-params.dynamodb.*", self._keep_params)
        events.register("before-call.dynamodb.*", self._before)
        events.register("after-call.dynamodb.*", self._after)
        self._count_moto_cpu()

    def detach(self) -> None:
        """Stop metering: new clients are not hooked (made from a fresh default session), and moto's
        CPU is no longer counted."""
        import boto3
        from moto.core.botocore_stubber import BotocoreStubber

        boto3.setup_default_session()
        original = getattr(BotocoreStubber, "_unmetered", None)
        if original is not None:
            BotocoreStubber.process_request = original  # type: ignore[method-assign]
            del BotocoreStubber._unmetered  # type: ignore[attr-defined]

    def _count_moto_cpu(self) -> None:
        from moto.core.botocore_stubber import BotocoreStubber

        original = getattr(BotocoreStubber, "_unmetered", BotocoreStubber.process_request)
        meter = self

        def process_request(stubber: Any, request: Any) -> Any:
            if getattr(meter._local, "inside", False):
                return original(stubber, request)
            started = time.thread_time()
            try:
                return original(stubber, request)
            finally:
                meter._exclude(time.thread_time() - started)

        BotocoreStubber._unmetered = original  # type: ignore[attr-defined]
        BotocoreStubber.process_request = process_request  # type: ignore[method-assign, assignment]

    def _exclude(self, seconds: float) -> None:
        with self._lock:
            self.excluded_cpu += seconds

    @contextmanager
    def _own_work(self) -> Iterator[None]:
        started = time.thread_time()
        self._local.inside = True
        try:
            yield
        finally:
            self._local.inside = False
            self._exclude(time.thread_time() - started)

    def _keep_params(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["meter_params"] = dict(params)

    def _before(self, model: Any, context: dict[str, Any], **_: Any) -> None:
        if model.name not in WRITES:
            return
        with self._own_work():
            context["meter_before"] = [
                (table, key, self.read_item(table, key)) for table, key in self._written(model.name, context)
            ]

    def _after(self, model: Any, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        with self._own_work():
            params = context.get("meter_params", {})
            code = parsed.get("Error", {}).get("Code")
            bill = Bill()
            bill.calls[model.name] += 1
            if model.name in WRITES:
                if code not in (None, "ConditionalCheckFailedException"):
                    return  # throttled or refused: not written, not billed
                applied = code is None
                bill.failed_conditions += int(not applied)
                for table, key, before in context.get("meter_before", []):
                    after = self.read_item(table, key) if applied else before
                    self._charge(bill, table, key, write_cost(self.tables[table], before, after, applied))
            elif model.name in READS and code is None:
                self._reads(bill, model.name, params, parsed)
            with self._lock:
                self.bill.add(bill)

    # Writes --------------------------------------------------------------------------------------

    def _written(self, op: str, context: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        params = context.get("meter_params", {})
        if op == "BatchWriteItem":
            out = []
            for table, requests in params.get("RequestItems", {}).items():
                for request in requests:
                    if "PutRequest" in request:
                        out.append((table, self._key(table, request["PutRequest"]["Item"])))
                    else:
                        out.append((table, request["DeleteRequest"]["Key"]))
            return out
        table = params["TableName"]
        return [(table, params["Key"] if "Key" in params else self._key(table, params["Item"]))]

    def _key(self, table: str, item: dict[str, Any]) -> dict[str, Any]:
        return {name: item[name] for name in self.tables[table].keys}

    def _charge(self, bill: Bill, table: str, key: dict[str, Any], cost: WriteCost) -> None:
        schema = self.tables[table]
        bill.wcu[table] += cost.table
        plain = schema.key_of(key)
        bill.item_wcu[(table, plain)] += cost.table
        bill.partition_wcu[(table, plain[0])] += cost.table
        if not cost.indexes:
            return
        now = self.read_item(table, key)
        for index in schema.indexes:
            units = cost.indexes.get(index.name)
            if not units:
                continue
            bill.wcu[f"{table}/{index.name}"] += units
            entry = schema.entry(now, index)
            hash_value = _plain(entry[index.keys[0]]) if entry else None
            bill.partition_wcu[(f"{table}/{index.name}", hash_value)] += units

    # Reads ---------------------------------------------------------------------------------------

    def _reads(self, bill: Bill, op: str, params: dict[str, Any], parsed: dict[str, Any]) -> None:
        consistent = bool(params.get("ConsistentRead"))
        if op == "GetItem":
            table = params["TableName"]
            item = self.read_item(table, params["Key"])
            size = item_size(item)
            units = read_units(size, consistent)
            bill.rcu[table] += units
            bill.items_read[table] += int(item is not None)
            bill.partition_rcu[(table, self.tables[table].key_of(params["Key"])[0])] += units
        elif op == "BatchGetItem":
            for table, found in parsed.get("Responses", {}).items():
                request = params["RequestItems"][table]
                consistent = bool(request.get("ConsistentRead"))
                for answered in found:
                    key = self._key_from_answer(table, answered)
                    item = self.read_item(table, key) if key else answered
                    units = read_units(item_size(item), consistent)
                    bill.rcu[table] += units
                    bill.items_read[table] += 1
                    hash_value = self.tables[table].key_of(key)[0] if key else None
                    bill.partition_rcu[(table, hash_value)] += units
        else:  # Query, Scan: the whole items (or index entries) read, summed per call
            table = params["TableName"]
            schema = self.tables[table]
            index = next((i for i in schema.indexes if i.name == params.get("IndexName")), None)
            hash_value = self._hash_of_condition(params, index.keys[0] if index else schema.keys[0])
            size = 0
            items = parsed.get("Items", [])
            for answered in items:
                key = self._key_from_answer(table, answered, params)
                full = self.read_item(table, key) if key else None
                if full is None:
                    full = answered
                size += item_size(schema.entry(full, index) if index else full)
            units = read_units(size, consistent)
            label = f"{table}/{index.name}" if index else table
            bill.rcu[label] += units
            bill.items_read[label] += len(items)
            bill.partition_rcu[(label, hash_value)] += units

    def _key_from_answer(
        self, table: str, answered: dict[str, Any], params: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The table key of an item in an answer; a projection may have left the hash key out, which
        the query's key condition names (``#pk = :pk``)."""
        schema = self.tables[table]
        key = {}
        for name in schema.keys:
            if name in answered:
                key[name] = answered[name]
            elif params is not None and "IndexName" not in params and name == schema.keys[0]:
                value = self._hash_of_condition(params, name)
                if value is None:
                    return None
                key[name] = {"S": value} if isinstance(value, str) else value
            else:
                return None
        return key

    @staticmethod
    def _hash_of_condition(params: dict[str, Any], hash_name: str) -> Any:
        condition = params.get("KeyConditionExpression", "")
        names = params.get("ExpressionAttributeNames", {})
        values = params.get("ExpressionAttributeValues", {})
        for left, right in re.findall(r"([#\w]+)\s*=\s*(:\w+)", condition):
            if names.get(left, left) == hash_name and right in values:
                return _plain(values[right])
        return None

    # Reading the bill ----------------------------------------------------------------------------

    def take(self) -> Bill:
        """The bill so far, and a fresh one from here."""
        with self._lock:
            bill, self.bill = self.bill, Bill()
        return bill


def moto_item_reader(
    account: str = "123456789012", region: str = "us-east-1"
) -> Callable[[str, dict[str, Any]], dict[str, Any] | None]:
    """Read an item as stored from moto's in-process backend (no API call, so nothing billed)."""
    from moto.dynamodb.models import dynamodb_backends

    backend = dynamodb_backends[account][region]

    def read(table: str, key: dict[str, Any]) -> dict[str, Any] | None:
        item = backend.get_item(table, key)
        return None if item is None else item.to_json()["Attributes"]

    return read
