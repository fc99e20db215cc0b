"""Stored events read back at full resolution (contract 9): ``GET .../rank-metrics`` and, for ``run.log``,
``GET .../scalars?raw=1``, one page at a time.

A page holds the events of a step window ordered by (step, rank, event_id), filtered by keys and ranks,
each value exactly as stored (float64 as JSON numbers, which Python writes and reads back bit for bit;
NaN and Infinity as the contract's strings). It is columnar: the page's ``keys`` once, and per event a
``values`` list aligned with them (``null`` where that event has no such key), so a key's name is never
repeated per event. A page is bounded twice: the store reads at most about ``limit`` events from the
cursor on (whole steps, and a step holds at most 512 ranks' events), and the page stops once it holds
``MAX_PAGE_VALUES`` values, wherever that falls; ``next_cursor`` (opaque: the step, rank and event id of
the last event given) says where the next page starts, and is null on the last one. So a page's memory
and size do not depend on the run's length, and on DynamoDB each page is one query per shard from the
cursor's step.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from instantml import limits
from shared.errors import FieldError, NotFound
from shared.store.port import EventRows, RowsWanted
from shared.summary.query import Params

#: Events a page reads at most (``limit``); whatever the limit, a page holds ``MAX_PAGE_VALUES`` values at
#: most, so a large limit serves a read of few keys (one key: 100,000 events a page).
DEFAULT_LIMIT, MAX_LIMIT = 1000, 100_000
#: Values in one page at most: about 2.5 MB of JSON at 25 bytes a value, within what a Lambda answers.
MAX_PAGE_VALUES = 100_000
PARAMETERS = {"keys", "ranks", "step_min", "step_max", "limit", "cursor", "encoding"}
#: ``json``: each event an object, its values a list (NaN and Infinity as strings); ``base64``: the page
#: columnar, its floats as base64 of little-endian float64 (10.7 bytes a value instead of about 19, and
#: no float parsed or printed on either side), for programs (``im.Api`` asks for it).
ENCODINGS = ("json", "base64")
#: Values a base64 page holds at most (2.7 MB of them), and what any page may take with its event ids.
MAX_BASE64_VALUES = 250_000
MAX_PAGE_BYTES = 4_000_000
#: A page's first read, which tells how many values an event holds (so how many events fill the page).
FIRST_READ = 1024


@dataclass(frozen=True)
class RawQuery:
    keys: tuple[str, ...] | None = None
    ranks: frozenset[int] | None = None
    step_min: int = 0
    step_max: int | None = None
    limit: int = DEFAULT_LIMIT
    after: tuple[int, int, str] | None = None  # the cursor: the last event given
    encoding: str = "json"

    @property
    def max_values(self) -> int:
        return MAX_BASE64_VALUES if self.encoding == "base64" else MAX_PAGE_VALUES


def parse_query(params: dict[str, str], known: set[str] = PARAMETERS) -> RawQuery:
    """``keys``, ``ranks`` (``0,3,8-15``), ``step_min``, ``step_max``, ``limit``, ``cursor``; a bad one
    raises ``InvalidInput`` naming it."""
    query = Params(params, known)
    step_min, step_max = query.window()
    limit = query.integer("limit", 1, MAX_LIMIT) or DEFAULT_LIMIT
    ranks = _ranks(params.get("ranks"), query.errors)
    after = _cursor(params.get("cursor"), query.errors)
    encoding = params.get("encoding") or "json"
    if encoding not in ENCODINGS:
        query.errors.append(
            FieldError("encoding", f"must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        )
    query.check()
    return RawQuery(query.keys(), ranks, step_min or 0, step_max, limit, after, encoding)


def _ranks(raw: str | None, errors: list[FieldError]) -> frozenset[int] | None:
    if not raw:
        return None
    ranks: set[int] = set()
    for part in raw.split(","):
        low, _, high = part.partition("-")
        ok = low.isascii() and low.isdigit() and (not high or (high.isascii() and high.isdigit()))
        if not ok or len(low) > 3 or len(high) > 3:
            errors.append(FieldError("ranks", f"must be ranks and ranges such as 0,3,8-15, got {part!r}"))
            return None
        first, last = int(low), int(high or low)
        if not first <= last < limits.MAX_WORLD_SIZE:
            errors.append(FieldError("ranks", f"must be ranks from 0 to {limits.MAX_WORLD_SIZE - 1}"))
            return None
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def encode_cursor(step: int, rank: int, event_id: str) -> str:
    text = json.dumps([step, rank, event_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _cursor(raw: str | None, errors: list[FieldError]) -> tuple[int, int, str] | None:
    if not raw:
        return None
    try:
        if len(raw) > 1024:
            raise ValueError
        step, rank, event_id = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        if not (isinstance(step, int) and isinstance(rank, int) and isinstance(event_id, str)):
            raise ValueError
        if not (0 <= step <= limits.MAX_STEP and 0 <= rank <= limits.MAX_WORLD_SIZE):
            raise ValueError
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        errors.append(FieldError("cursor", "must be the next_cursor of an earlier page of this route"))
        return None
    return step, rank, event_id


def read_page(
    read: Callable[[RowsWanted], EventRows],
    project: str,
    run_id: str,
    query: RawQuery,
    what: str = "rank events",
) -> dict[str, Any]:
    """One page of the run's events through ``read`` (the store's ``read_event_rows`` or
    ``read_scalar_rows``); ``NotFound`` for a run with none at all (asked without a cursor)."""
    wanted = RowsWanted(project, run_id, query.step_min, query.step_max, query.after, query.ranks)
    if query.keys is not None:  # at most one value a key an event: read what fills the page, once
        rows = read(wanted._replace(max_items=_fitting(query, len(query.keys))))
    else:  # the first read tells how many values an event holds, so how many more fill the page
        rows = read(wanted._replace(max_items=min(query.limit, FIRST_READ)))
        if rows.resume is not None and rows.event_id:
            held = sum(map(len, rows.keys)) / len(rows.keys)
            more = _fitting(query, math.ceil(held)) - len(rows.event_id)
            if more > 0:
                rows = _joined(rows, read(wanted._replace(after=rows.resume, max_items=more)))
    if not rows.event_id and query.after is None:
        probe = read(RowsWanted(project, run_id))
        if not probe.event_id and probe.resume is None:
            raise NotFound(f"run {run_id!r} of project {project!r} has no {what}")
    layout = _Layout(None if query.keys is None else set(query.keys))
    chosen, passed, one_list = _select(rows, layout, query)
    next_cursor = None
    if passed < len(rows.event_id):  # the page's budget cut it: on from the last event it passed
        next_cursor = encode_cursor(rows.step[passed - 1], rows.rank[passed - 1], rows.event_id[passed - 1])
    elif rows.resume is not None:
        next_cursor = encode_cursor(*rows.resume)
    if query.encoding == "base64":
        events: Any = _base64_columns(rows, chosen, layout, one_list)
    else:
        events = _json_rows(rows, chosen, layout)
    keys = list(layout.columns)
    return {"project": project, "run_id": run_id, "keys": keys, "events": events, "next_cursor": next_cursor}


#: A page's size as sent, about: per event (its fields, beside its id) and per value, by encoding.
_EVENT_BYTES = {"json": 100, "base64": 40}
_VALUE_BYTES = {"json": 25, "base64": 11}
#: The id's length assumed when a page's read is sized (the client's ids are 32 characters).
_ID_BYTES = 34


def _fitting(query: RawQuery, values_per_event: int) -> int:
    """Events that fill a page whose events hold ``values_per_event`` values each."""
    per_event = max(1, values_per_event)
    size = _EVENT_BYTES[query.encoding] + _ID_BYTES + _VALUE_BYTES[query.encoding] * per_event
    return max(1, min(query.limit, query.max_values // per_event, MAX_PAGE_BYTES // size))


def _distinct(key_lists: list[list[str]]) -> dict[int, list[str]]:
    """The distinct key list objects (by id), in the order they first appear."""
    return dict(zip(map(id, key_lists), key_lists, strict=True))


def _joined(first: EventRows, second: EventRows) -> EventRows:
    """Two reads as one; the second's key lists replaced by the first's equal ones, so that events with
    the same keys share one list object still (the page then maps them once, as one group)."""
    known = {tuple(keys): keys for keys in _distinct(first.keys).values()}
    swap = {i: known.get(tuple(keys), keys) for i, keys in _distinct(second.keys).items()}
    if len(swap) == 1:
        second_keys = [next(iter(swap.values()))] * len(second.keys)
    else:
        second_keys = [swap[id(keys)] for keys in second.keys]
    return EventRows(
        first.event_id + second.event_id,
        first.step + second.step,
        first.rank + second.rank,
        first.world_size + second.world_size,
        first.local_rank + second.local_rank,
        first.keys + second_keys,
        first.packed + second.packed,
        second.resume,
    )


def _select(rows: EventRows, layout: _Layout, query: RawQuery) -> tuple[list[int], int, bool]:
    """The page's events (their positions in ``rows``: those holding a wanted key, within the page's
    values and bytes), how many events of ``rows`` the page passed (given or without a wanted key), and
    whether they all share one key list."""
    import numpy as np

    n = len(rows.event_id)
    if not n:
        return [], 0, True
    distinct = _distinct(rows.keys)
    held = {i: len(layout.places(keys)) for i, keys in distinct.items()}
    if len(held) == 1:
        values = np.full(n, next(iter(held.values())), np.int64)
    else:
        values = np.fromiter((held[id(keys)] for keys in rows.keys), np.int64, n)
    sizes = _EVENT_BYTES[query.encoding] + _VALUE_BYTES[query.encoding] * values
    sizes += np.fromiter(map(len, rows.event_id), np.int64, n)
    sizes[values == 0] = 0
    over = (np.cumsum(values) > query.max_values) | (np.cumsum(sizes) > MAX_PAGE_BYTES)
    passed = n
    if over[-1]:
        first_held = int(np.argmax(values > 0))
        passed = max(int(np.argmax(over)), first_held + 1)  # a page holds one event at least
    return np.flatnonzero(values[:passed]).tolist(), passed, len(distinct) == 1


_INF = math.inf


class _Layout:
    """The page's key columns (added as they first appear) and, per distinct key list of the events
    (events read together share one list object), where each of its values goes."""

    def __init__(self, wanted: set[str] | None) -> None:
        self.wanted = wanted
        self.columns: dict[str, int] = {}
        self._places: dict[int, tuple[list[str], list[tuple[int, int]]]] = {}  # id(keys) -> places

    def places(self, keys: list[str]) -> list[tuple[int, int]]:
        """(column, position in the event's values) of each wanted value of an event with ``keys``."""
        known = self._places.get(id(keys))
        if known is None or known[0] is not keys:
            wanted = self.wanted
            places = [
                (self.columns.setdefault(k, len(self.columns)), i)
                for i, k in enumerate(keys)
                if wanted is None or k in wanted
            ]
            known = self._places[id(keys)] = (keys, places)
        return known[1]


def _json_rows(rows: EventRows, chosen: list[int], layout: _Layout) -> list[dict[str, Any]]:
    """Each event as an object, its values by column (NaN and Infinity as the contract's strings)."""
    structs: dict[int, struct.Struct] = {}
    width = len(layout.columns)
    out = []
    for at in chosen:
        packed = rows.packed[at]
        n = len(packed) // 8
        unpack = structs.get(n) or structs.setdefault(n, struct.Struct(f"<{n}d"))
        numbers = unpack.unpack(packed)
        values: list[float | str | None] = [None] * width
        for column, i in layout.places(rows.keys[at]):
            x = numbers[i + 2]
            values[column] = x if -_INF < x < _INF else limits.wire_value(x)  # NaN fails both
        out.append(
            {
                "event_id": rows.event_id[at],
                "step": rows.step[at],
                "rank": rows.rank[at],
                "world_size": rows.world_size[at],
                "local_rank": rows.local_rank[at],
                "weight": numbers[0],
                "time": numbers[1],
                "values": values,
            }
        )
    return out


def _base64_columns(rows: EventRows, chosen: list[int], layout: _Layout, one_list: bool) -> dict[str, Any]:
    """The events columnar: their fields as lists, weights, times and values (events x keys, row by
    row) as base64 of little-endian float64, and which values are there as a bit per cell (numpy's
    ``packbits``, row by row, most significant bit first)."""
    import numpy as np

    n, width = len(chosen), len(layout.columns)
    weight, time = np.zeros(n), np.zeros(n)
    values = np.full((n, width), np.nan)
    present = np.zeros((n, width), dtype=bool)
    groups: dict[int, list[int]] = {}  # id(keys) -> the page's rows with those keys
    if n and one_list:
        groups[id(rows.keys[chosen[0]])] = list(range(n))  # (the common case: one key list)
    else:
        for row, at in enumerate(chosen):
            groups.setdefault(id(rows.keys[at]), []).append(row)
    for members in groups.values():
        keys = rows.keys[chosen[members[0]]]
        flat = np.frombuffer(b"".join([rows.packed[chosen[r]] for r in members]), "<f8")
        block = flat.reshape(len(members), len(keys) + 2)
        where = np.asarray(members)
        weight[where], time[where] = block[:, 0], block[:, 1]
        places = layout.places(keys)
        columns = [c for c, _ in places]
        values[np.ix_(where, columns)] = block[:, [i + 2 for _, i in places]]
        present[np.ix_(where, columns)] = True

    def b64(array: Any) -> str:
        return base64.b64encode(np.ascontiguousarray(array, "<f8").tobytes()).decode()

    prefix = not n or chosen[-1] == n - 1  # (ascending positions: the first n events of the read)

    def column(values: list[Any]) -> list[Any]:
        return values[:n] if prefix else [values[at] for at in chosen]

    return {
        "count": n,
        "event_id": column(rows.event_id),
        "step": column(rows.step),
        "rank": column(rows.rank),
        "world_size": column(rows.world_size),
        "local_rank": column(rows.local_rank),
        "weight": b64(weight),
        "time": b64(time),
        "values": b64(values),
        "present": base64.b64encode(np.packbits(present, axis=None).tobytes()).decode(),
    }
