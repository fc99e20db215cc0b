"""Storing rank events: the single and batch use cases behind the two POST routes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from instantml import limits
from shared.models import (
    EventIdReused,
    FieldError,
    InvalidInput,
    PayloadTooLarge,
    RankEventBody,
    field_errors,
    parse_rank_event,
    to_rank_event,
)
from shared.store import MetricsStore


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


def store_rank_event(
    store: MetricsStore, project: str, run_id: str, body: bytes, idempotency_key: str | None, now: float
) -> tuple[str, Literal["stored", "duplicate"]]:
    """Validate and store one event; returns its id and whether it was new."""
    if len(body) > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(f"an event body may be at most {limits.MAX_EVENT_BYTES} bytes, got {len(body)}")
    event = parse_rank_event(project, run_id, body, unquote_idempotency_key(idempotency_key), now)
    return event.event_id, store.put_event(event)


@dataclass
class BatchResult:
    results: list[dict[str, Any]]

    def counts(self) -> dict[str, int]:
        statuses = [r["status"] for r in self.results]
        return {s: statuses.count(s) for s in ("stored", "duplicate", "rejected")}


def store_rank_event_batch(
    store: MetricsStore, project: str, run_id: str, body: bytes, now: float
) -> BatchResult:
    """Validate a batch as a whole, then store each event on its own (one bad event stops nothing)."""
    if len(body) > limits.MAX_BATCH_BYTES:
        raise PayloadTooLarge(f"a batch may be at most {limits.MAX_BATCH_BYTES} bytes, got {len(body)}")
    try:
        document = json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InvalidInput(f"body is not valid JSON: {exc}", [FieldError("body", "must be JSON")]) from None
    events = document.get("events") if isinstance(document, dict) else None
    if not isinstance(events, list) or not 1 <= len(events) <= limits.MAX_BATCH_EVENTS:
        raise InvalidInput(
            f"body must be an object with 'events': a list of 1-{limits.MAX_BATCH_EVENTS} events",
            [FieldError("events", f"must be a list of 1-{limits.MAX_BATCH_EVENTS} events")],
        )
    missing = [
        FieldError(
            f"events.{i}.event_id", "is required in a batch and must be 1-255 printable ASCII characters"
        )
        for i, e in enumerate(events)
        if not (isinstance(e, dict) and limits.is_valid_event_id(e.get("event_id")))
    ]
    if missing:
        raise InvalidInput(f"{missing[0].field} {missing[0].message}", missing)
    results = []
    for item in events:
        event_id = item["event_id"]
        try:
            if len(json.dumps(item)) > limits.MAX_EVENT_BYTES:
                raise PayloadTooLarge(f"an event may be at most {limits.MAX_EVENT_BYTES} bytes")
            try:
                parsed = RankEventBody.model_validate(item)
            except ValidationError as exc:
                details = field_errors(exc)
                raise InvalidInput(f"{details[0].field}: {details[0].message}", details) from None
            status = store.put_event(to_rank_event(project, run_id, parsed, event_id, now))
            results.append({"event_id": event_id, "status": status})
        except (InvalidInput, PayloadTooLarge, EventIdReused) as exc:
            results.append({"event_id": event_id, "status": "rejected", "error": exc.error_object()})
    return BatchResult(results)


def _reject_constant(name: str) -> Any:
    raise ValueError(f'{name} is not JSON; send non-finite metric values as the string "{name}"')
