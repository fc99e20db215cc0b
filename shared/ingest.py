"""Storing events: the single and batch use cases behind the POST routes of rank events and of
``run.log`` scalars (``scalar=True``). Whatever is accepted (stored, or a replay of a stored event) is
then noted on the run's record, so that the runs index never reads events."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from instantml import limits
from shared.models import (
    DomainError,
    EventIdReused,
    FieldError,
    InvalidInput,
    PayloadTooLarge,
    RankEvent,
    parse_event,
    parse_json,
    to_rank_event,
    validate_body,
    validate_scalar_body,
)
from shared.runs import ActivityNotes, activity
from shared.store.port import MetricsStore, PutOutcome


def unquote_idempotency_key(header: str | None) -> str | None:
    """The event id of an ``Idempotency-Key`` header, bare or quoted; a bad one raises ``InvalidInput``."""
    if header is None:
        return None
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not limits.is_valid_event_id(value):
        raise InvalidInput(
            "Idempotency-Key must be 1-255 printable ASCII characters",
            [FieldError("Idempotency-Key", "must be 1-255 printable ASCII characters")],
        )
    return value


#: This process's memory of its notes on run records, per store (one per warm function).
_NOTES: weakref.WeakKeyDictionary[MetricsStore, ActivityNotes] = weakref.WeakKeyDictionary()


def _note(
    store: MetricsStore, project: str, run_id: str, events: list[RankEvent], now: float, scalar: bool
) -> None:
    notes = _NOTES.get(store)
    if notes is None:
        notes = _NOTES[store] = ActivityNotes()
    notes.note(store, project, run_id, activity(events, now, scalar))


def _put(store: MetricsStore, events: list[RankEvent], scalar: bool) -> list[PutOutcome]:
    return store.put_scalars(events) if scalar else store.put_events(events)


def store_rank_event(
    store: MetricsStore,
    project: str,
    run_id: str,
    body: bytes,
    idempotency_key: str | None,
    now: float,
    scalar: bool = False,
) -> tuple[str, Literal["stored", "duplicate"]]:
    """Validate and store one event; returns its id and whether it was new."""
    if len(body) > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(
            f"an event body may be at most {limits.MAX_EVENT_BYTES} bytes, got {len(body)}",
            [FieldError("body", f"must be at most {limits.MAX_EVENT_BYTES} bytes")],
        )
    event = parse_event(project, run_id, body, unquote_idempotency_key(idempotency_key), now, scalar)
    (outcome,) = _put(store, [event], scalar)
    if isinstance(outcome, EventIdReused):
        raise outcome
    _note(store, project, run_id, [event], now, scalar)
    return event.event_id, outcome


@dataclass
class BatchResult:
    results: list[dict[str, Any]]

    def counts(self) -> dict[str, int]:
        statuses = [r["status"] for r in self.results]
        return {s: statuses.count(s) for s in ("stored", "duplicate", "rejected")}


def store_rank_event_batch(
    store: MetricsStore, project: str, run_id: str, body: bytes, now: float, scalar: bool = False
) -> BatchResult:
    """Validate a batch as a whole, then store its valid events (one bad event stops nothing).

    Whole-request problems (size, JSON, shape, a missing or repeated ``event_id``) raise before
    anything is stored. A store failure raises ``StoreUnavailable`` for the whole batch; since every
    put is conditional, the client retries the same batch and gets ``duplicate`` for what was stored.
    """
    if len(body) > limits.MAX_BATCH_BYTES:
        raise PayloadTooLarge(
            f"a batch may be at most {limits.MAX_BATCH_BYTES} bytes, got {len(body)}",
            [FieldError("body", f"must be at most {limits.MAX_BATCH_BYTES} bytes")],
        )
    events = _batch_events(parse_json(body))
    results: list[dict[str, Any] | None] = [None] * len(events)
    valid: list[tuple[int, RankEvent]] = []
    for i, item in enumerate(events):
        try:
            valid.append((i, _batch_event(project, run_id, item, now, scalar)))
        except DomainError as exc:
            results[i] = {"event_id": item["event_id"], "status": "rejected", "error": exc.error_object()}
    outcomes = _put(store, [event for _, event in valid], scalar)
    accepted = []
    for (i, event), outcome in zip(valid, outcomes, strict=True):
        if isinstance(outcome, DomainError):
            results[i] = {"event_id": event.event_id, "status": "rejected", "error": outcome.error_object()}
        else:
            results[i] = {"event_id": event.event_id, "status": outcome}
            accepted.append(event)
    if accepted:
        _note(store, project, run_id, accepted, now, scalar)
    return BatchResult([r for r in results if r is not None])


def _batch_events(document: Any) -> list[dict[str, Any]]:
    """The ``events`` list of a batch, each with a valid ``event_id`` unique in the batch."""
    events = document.get("events") if isinstance(document, dict) else None
    if not isinstance(events, list) or not 1 <= len(events) <= limits.MAX_BATCH_EVENTS:
        raise InvalidInput(
            f"body must be an object with 'events': a list of 1-{limits.MAX_BATCH_EVENTS} events",
            [FieldError("events", f"must be a list of 1-{limits.MAX_BATCH_EVENTS} events")],
        )
    problems = []
    first_index: dict[str, int] = {}
    for i, event in enumerate(events):
        event_id = event.get("event_id") if isinstance(event, dict) else None
        if not isinstance(event_id, str) or not limits.is_valid_event_id(event_id):
            problems.append(
                FieldError(
                    f"events.{i}.event_id",
                    "is required in a batch and must be 1-255 printable ASCII characters",
                )
            )
        elif first_index.setdefault(event_id, i) != i:
            # Two events under one id in one request cannot both be right; which one would win
            # would depend on the order of concurrent puts. The whole request is refused.
            problems.append(FieldError(f"events.{i}.event_id", f"repeats events.{first_index[event_id]}"))
    if problems:
        raise InvalidInput(f"{problems[0].field} {problems[0].message}", problems)
    return events


def _batch_event(project: str, run_id: str, item: dict[str, Any], now: float, scalar: bool) -> RankEvent:
    # The 64 KiB limit applies to each event as compact JSON, however the batch was formatted.
    # Serializing every event to measure it would cost a third of a batch's time; most events are
    # far below the limit by a bound that needs no serializing.
    if _size_bound(item) > limits.MAX_EVENT_BYTES:
        _check_size(item)
    body = validate_scalar_body(item) if scalar else validate_body(item)
    return to_rank_event(project, run_id, body, item["event_id"], now)


#: A bound on the compact JSON of any event's fields other than its metrics and event id.
_FIXED_FIELDS_BYTES = 512
_SHORT_VALUE_BYTES = 32  # a float's repr, a bounded int, "-Infinity", with quotes and separators


def _size_bound(item: dict[str, Any]) -> int:
    """An upper bound of ``item``'s compact JSON size in bytes, or a huge number when it has none
    that is cheap to know (then the size is measured)."""
    metrics = item.get("metrics")
    if not isinstance(metrics, dict) or len(item) > 8:
        return _UNKNOWN
    if not set(map(type, metrics.values())) <= _FLOAT and not all(map(_is_short, metrics.values())):
        return _UNKNOWN
    others = [v for k, v in item.items() if k != "metrics" and k != "event_id"]
    if not all(map(_is_short, others)):
        return _UNKNOWN
    # A character is at most 6 bytes (a \\u escape); per key, quotes, colon and comma and a short value.
    keys = sum(map(len, metrics))
    per_key = 8 + _SHORT_VALUE_BYTES
    return _FIXED_FIELDS_BYTES + 6 * len(str(item.get("event_id"))) + 6 * keys + per_key * len(metrics)


_UNKNOWN = 1 << 62
_FLOAT = {float}
_SHORT_TYPES = {float, type(None)}


def _is_short(value: Any) -> bool:
    kind = type(value)
    return (
        kind in _SHORT_TYPES
        or (kind is int and -(10**18) < value < 10**18)
        or (kind is str and len(value) <= 12)
    )


def _check_size(item: dict[str, Any]) -> None:
    size = len(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(
            f"an event may be at most {limits.MAX_EVENT_BYTES} bytes as compact JSON, got {size}",
            [FieldError("body", f"must be at most {limits.MAX_EVENT_BYTES} bytes")],
        )
