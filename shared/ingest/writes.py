"""Storing events: the single and batch use cases behind the POST routes of rank events
(``RankEvent``) and of ``run.log`` scalars (``ScalarEvent``). A request is parsed whole by
``shared.ingest.parse`` (every limit, every event), then stored through the port; whatever is accepted
(stored, or a replay of a stored event) is then noted on the run's record, so that the runs index never reads
events. A note the store refuses (throttled, failing) never fails the request: its events are stored,
and a 429 would only make the client send them again; the note waits for the run's next batch
(``ActivityNotes``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal, cast

from shared.errors import DomainError, EventIdReused
from shared.events import Event, EventKind, RankEvent, ScalarEvent
from shared.ingest.activity import ActivityNotes
from shared.store.port import IngestStore, PutOutcome

# The bodies' validation (shared.ingest.parse: pydantic) is imported by the first request that parses one,
# not by the function's cold start.

#: This process's memory of its notes on run records, per store (one per warm function).
_NOTES: weakref.WeakKeyDictionary[IngestStore, ActivityNotes] = weakref.WeakKeyDictionary()


def _note(store: IngestStore, project: str, run_id: str, events: list[Event], now: float) -> bool:
    """Note accepted events on their run's record; False when the store refused the note now (it is
    kept for the run's next note: the events are stored, and their request succeeds all the same)."""
    notes = _NOTES.get(store)
    if notes is None:
        notes = _NOTES[store] = ActivityNotes(store.run_time_resolution_s)
    return notes.note_events(store, project, run_id, events, now)


def _put(store: IngestStore, kind: EventKind, events: list[Event]) -> list[PutOutcome]:
    # A request's events are all of its route's kind (shared.ingest.parse builds them so).
    if kind is ScalarEvent:
        return store.put_scalars(cast("list[ScalarEvent]", events))
    return store.put_events(cast("list[RankEvent]", events))


def store_event(
    store: IngestStore,
    project: str,
    run_id: str,
    body: bytes,
    idempotency_key: str | None,
    now: float,
    kind: EventKind = RankEvent,
) -> tuple[str, Literal["stored", "duplicate"]]:
    """Validate and store one ``kind`` event; returns its id and whether it was new."""
    from shared.ingest.parse import parse_event

    event = parse_event(project, run_id, body, idempotency_key, now, kind)
    (outcome,) = _put(store, kind, [event])
    if isinstance(outcome, EventIdReused):
        raise outcome
    _note(store, project, run_id, [event], now)
    return event.event_id, outcome


@dataclass(frozen=True)
class BatchResult:
    results: list[dict[str, Any]]  # one per event, in the batch's order
    counts: dict[str, int]  # how many were stored, duplicate and rejected
    run_noted: bool = True  # False: the run's record could not be updated now (its next batch will)


def store_event_batch(
    store: IngestStore, project: str, run_id: str, body: bytes, now: float, kind: EventKind = RankEvent
) -> BatchResult:
    """Validate a batch as a whole, then store its valid events (one bad event stops nothing).

    Whole-request problems (size, JSON, shape, a missing or repeated ``event_id``) raise before
    anything is stored. A store failure raises ``StoreUnavailable`` for the whole batch; since every
    put is conditional, the client retries the same batch and gets ``duplicate`` for what was stored.
    """
    from shared.ingest.parse import Rejected, parse_batch

    parsed = parse_batch(project, run_id, body, now, kind)
    outcomes = iter(_put(store, kind, [item for item in parsed if not isinstance(item, Rejected)]))
    results: list[dict[str, Any]] = []
    accepted: list[Event] = []
    for item in parsed:
        outcome = item.error if isinstance(item, Rejected) else next(outcomes)
        if isinstance(outcome, DomainError):
            results.append({"event_id": item.event_id, "status": "rejected", "error": outcome.error_object()})
        elif not isinstance(item, Rejected):
            results.append({"event_id": item.event_id, "status": outcome})
            accepted.append(item)
    noted = _note(store, project, run_id, accepted, now) if accepted else True
    statuses = [result["status"] for result in results]
    return BatchResult(results, {s: statuses.count(s) for s in ("stored", "duplicate", "rejected")}, noted)
