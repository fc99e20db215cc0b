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
from typing import Any, NamedTuple

from instantml import limits
from shared.errors import FieldError, NotFound
from shared.store.port import EventPage, StoredEvent
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
    read: Callable[..., EventPage], project: str, run_id: str, query: RawQuery, what: str = "rank events"
) -> dict[str, Any]:
    """One page of the run's events through ``read`` (the store's ``read_events`` or ``read_scalars``);
    ``NotFound`` for a run with none at all (asked without a cursor)."""
    if query.after is None:
        probe = read(project, run_id, 0, None, max_items=1)  # (cut before its first step: there is one)
        if not probe.events and probe.complete_through is None:
            raise NotFound(f"run {run_id!r} of project {project!r} has no {what}")
    start = _start(query)
    if query.step_max is not None and start > query.step_max:
        return _document(project, run_id, [], _Layout(None), None, query.encoding)
    if query.keys is not None:  # at most one value a key an event: read what fills the page, once
        page = _read(
            read, project, run_id, start, query, min(query.limit, query.max_values // len(query.keys))
        )
    else:
        page = _read(read, project, run_id, start, query, min(query.limit, FIRST_READ))
    if query.keys is None and page.complete_through is not None and page.events and query.limit > FIRST_READ:
        # Read as many events as the page's values will fill (the first read says how many values an
        # event holds), not ``limit`` events of which most would be dropped at MAX_PAGE_VALUES.
        wanted = None if query.keys is None else set(query.keys)
        held = sum(len(e.keys) if wanted is None else len(wanted.intersection(e.keys)) for e in page.events)
        size = min(query.limit, int(query.max_values * len(page.events) / max(held, 1)) + 1)
        if size > FIRST_READ:
            page = _read(read, project, run_id, start, query, size)
    events = sorted(page.events, key=lambda e: (e.step, e.rank, e.event_id))
    if query.after is not None:
        events = [e for e in events if (e.step, e.rank, e.event_id) > query.after]
    chosen, layout, last, cut = _select(events, query)
    next_cursor = None
    if last is not None and (cut or page.complete_through is not None):
        next_cursor = encode_cursor(last.step, last.rank, last.event_id)
    elif page.complete_through is not None:  # the store stopped, and nothing after the cursor: go on past it
        next_cursor = encode_cursor(page.complete_through, limits.MAX_WORLD_SIZE, "")
    return _document(project, run_id, chosen, layout, next_cursor, query.encoding)


def _read(
    read: Callable[..., EventPage], project: str, run_id: str, start: int, query: RawQuery, size: int
) -> EventPage:
    page = read(project, run_id, start, query.step_max, max_items=size)
    if page.complete_through is not None and page.complete_through < start:
        # The first step alone holds more than ``size`` events (up to 512 ranks'): read that step whole.
        page = EventPage(read(project, run_id, start, start).events, start)
    return page


def _start(query: RawQuery) -> int:
    """The first step to read: the window's, or the cursor's (the next step when the cursor is past
    every rank of its own)."""
    if query.after is None:
        return query.step_min
    step, rank, _ = query.after
    return max(query.step_min, step + 1 if rank >= limits.MAX_WORLD_SIZE else step)


class _Chosen(NamedTuple):
    event: StoredEvent
    places: list[tuple[int, int]]  # (column, position in the event's values)
    width: int  # the columns known when it was chosen, through its own


def _select(
    events: list[StoredEvent], query: RawQuery
) -> tuple[list[_Chosen], _Layout, StoredEvent | None, bool]:
    """The page's events (filtered by ranks and keys, within the page's values and bytes), its key
    columns, the last event passed (given or filtered out), and whether the budget cut the page."""
    layout = _Layout(None if query.keys is None else set(query.keys))
    chosen: list[_Chosen] = []
    values = size = 0
    last: StoredEvent | None = None
    for event in events:
        if query.ranks is None or event.rank in query.ranks:
            places, width = layout.places(event.keys)
            if places:
                values += len(places)
                size += 100 + len(event.event_id) + 25 * len(places)  # (JSON's bytes, about)
                if chosen and (values > query.max_values or size > MAX_PAGE_BYTES):
                    return chosen, layout, last, True
                chosen.append(_Chosen(event, places, width))
        last = event
    return chosen, layout, last, False


_INF = math.inf


class _Layout:
    """The page's key columns (added as they first appear) and, per distinct key list of the events
    (events read together share one list object), where each of its values goes."""

    def __init__(self, wanted: set[str] | None) -> None:
        self.wanted = wanted
        self.columns: dict[str, int] = {}
        self._places: dict[int, tuple[list[str], list[tuple[int, int]], int]] = {}  # id(keys) -> places

    def places(self, keys: list[str]) -> tuple[list[tuple[int, int]], int]:
        known = self._places.get(id(keys))
        if known is None or known[0] is not keys:
            wanted = self.wanted
            places = [
                (self.columns.setdefault(k, len(self.columns)), i)
                for i, k in enumerate(keys)
                if wanted is None or k in wanted
            ]
            known = self._places[id(keys)] = (keys, places, max((c for c, _ in places), default=-1) + 1)
        return known[1], known[2]


def _document(
    project: str, run_id: str, chosen: list[_Chosen], layout: _Layout, next_cursor: str | None, encoding: str
) -> dict[str, Any]:
    keys = list(layout.columns)
    events = _base64_columns(chosen, len(keys)) if encoding == "base64" else _json_rows(chosen, len(keys))
    return {"project": project, "run_id": run_id, "keys": keys, "events": events, "next_cursor": next_cursor}


def _json_rows(chosen: list[_Chosen], width: int) -> list[dict[str, Any]]:
    """Each event as an object, its values by column (NaN and Infinity as the contract's strings)."""
    structs: dict[int, struct.Struct] = {}
    rows = []
    for event, places, _ in chosen:
        n = len(event.packed) // 8
        unpack = structs.get(n) or structs.setdefault(n, struct.Struct(f"<{n}d"))
        numbers = unpack.unpack(event.packed)
        values: list[float | str | None] = [None] * width
        for column, i in places:
            x = numbers[i + 2]
            values[column] = x if -_INF < x < _INF else limits.wire_value(x)  # NaN fails both
        rows.append(
            {
                "event_id": event.event_id,
                "step": event.step,
                "rank": event.rank,
                "world_size": event.world_size,
                "local_rank": event.local_rank,
                "weight": numbers[0],
                "time": numbers[1],
                "values": values,
            }
        )
    return rows


def _base64_columns(chosen: list[_Chosen], width: int) -> dict[str, Any]:
    """The events columnar: their fields as lists, weights, times and values (events x keys, row by
    row) as base64 of little-endian float64, and which values are there as a bit per cell (numpy's
    ``packbits``, row by row, most significant bit first)."""
    import numpy as np

    n = len(chosen)
    weight, time = np.zeros(n), np.zeros(n)
    values = np.full((n, width), np.nan)
    present = np.zeros((n, width), dtype=bool)
    groups: dict[int, list[int]] = {}
    for row, c in enumerate(chosen):
        groups.setdefault(id(c.event.keys), []).append(row)
    for rows in groups.values():
        first = chosen[rows[0]]
        flat = np.frombuffer(b"".join(chosen[r].event.packed for r in rows), "<f8")
        block = flat.reshape(len(rows), len(first.event.keys) + 2)
        at = np.asarray(rows)
        weight[at], time[at] = block[:, 0], block[:, 1]
        columns = [c for c, _ in first.places]
        taken = block[:, [i + 2 for _, i in first.places]]
        values[np.ix_(at, columns)] = taken
        present[np.ix_(at, columns)] = True

    def b64(array: Any) -> str:
        return base64.b64encode(np.ascontiguousarray(array, "<f8").tobytes()).decode()

    return {
        "count": n,
        "event_id": [c.event.event_id for c in chosen],
        "step": [c.event.step for c in chosen],
        "rank": [c.event.rank for c in chosen],
        "world_size": [c.event.world_size for c in chosen],
        "local_rank": [c.event.local_rank for c in chosen],
        "weight": b64(weight),
        "time": b64(time),
        "values": b64(values),
        "present": base64.b64encode(np.packbits(present, axis=None).tobytes()).decode(),
    }
