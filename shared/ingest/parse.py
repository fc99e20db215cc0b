"""A write request's events: its body's size, JSON (``shared.ingest.json_body``), fields
(``shared.ingest.bodies``) and ``Idempotency-Key`` header checked, and each event built as stored
(``shared.events``) with the digest that tells a retry from a reused id. A route's events are all of one kind
(``RankEvent`` for ``.../rank-metrics``, ``ScalarEvent`` for ``run.log``'s ``.../scalars``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

from pydantic import TypeAdapter, ValidationError

from instantml import limits
from shared.errors import DomainError, FieldError, InvalidInput, PayloadTooLarge
from shared.events import Event, EventKind, RankEvent, ScalarEvent
from shared.ingest.bodies import RankEventBody, ScalarEventBody, validate
from shared.ingest.json_body import (
    MAX_DETAILS,
    check_depth_of,
    check_text_of,
    parse_json,
    parse_json_deferred,
)

#: The body each kind of event arrives as, and how an error names it.
_BODIES: dict[EventKind, tuple[type[RankEventBody] | type[ScalarEventBody], str]] = {
    RankEvent: (RankEventBody, "rank event"),
    ScalarEvent: (ScalarEventBody, "scalar event"),
}


def _validate(kind: EventKind, document: Any) -> RankEventBody | ScalarEventBody:
    model, what = _BODIES[kind]
    return validate(model, document, what)


def parse_event(
    project: str, run_id: str, raw: bytes, idempotency_key: str | None, now: float, kind: EventKind
) -> Event:
    """One event request as a ``kind`` event: its size, JSON, fields and ``Idempotency-Key`` header
    checked."""
    if len(raw) > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(
            f"an event body may be at most {limits.MAX_EVENT_BYTES} bytes, got {len(raw)}",
            [FieldError("body", f"must be at most {limits.MAX_EVENT_BYTES} bytes")],
        )
    event_id = unquote_idempotency_key(idempotency_key)
    document = parse_json(raw)
    body = _validate(kind, document)
    if event_id is not None and body.event_id is not None and body.event_id != event_id:
        raise InvalidInput(
            "event_id in the body does not match the Idempotency-Key header",
            [FieldError("event_id", "must equal the Idempotency-Key header")],
        )
    return to_event(project, run_id, body, event_id or body.event_id, now)


def unquote_idempotency_key(header: str | None) -> str | None:
    """The event id of an ``Idempotency-Key`` header, bare or quoted; a bad one raises ``InvalidInput``."""
    if header is None:
        return None
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not limits.is_valid_event_id(value):
        raise InvalidInput(
            f"Idempotency-Key must be {limits.EVENT_ID_RULE}",
            [FieldError("Idempotency-Key", f"must be {limits.EVENT_ID_RULE}")],
        )
    return value


@dataclass(frozen=True)
class Rejected:
    """An event of a batch that is refused on its own (the rest of the batch is stored)."""

    event_id: str
    error: DomainError


def parse_batch(project: str, run_id: str, raw: bytes, now: float, kind: EventKind) -> list[Event | Rejected]:
    """A batch request's events, in order, each parsed or rejected on its own. Whole-request problems
    (size, JSON, nesting, shape, a missing or repeated ``event_id``) raise: nothing of such a batch is
    stored."""
    if len(raw) > limits.MAX_BATCH_BYTES:
        raise PayloadTooLarge(
            f"a batch may be at most {limits.MAX_BATCH_BYTES} bytes, got {len(raw)}",
            [FieldError("body", f"must be at most {limits.MAX_BATCH_BYTES} bytes")],
        )
    # A batch whose events are all valid nests four levels (body, events, an event, its metrics), so
    # walking it for its depth (a fifth of its parsing) is left until something in it is wrong: then,
    # before any error is told and before anything recursive (JSON encoding) sees it.
    document, check_text = parse_json_deferred(raw)
    try:
        items = _batch_events(document)
    except InvalidInput:
        check_depth_of(document, raw)
        raise
    bodies = _validated_all(kind, items)
    if check_text or any(isinstance(body, InvalidInput) for body in bodies):
        check_depth_of(document, raw)
    parsed: list[Event | Rejected] = []
    for item, body in zip(items, bodies, strict=True):
        try:
            if check_text:
                check_text_of(item)
            parsed.append(_batch_event(project, run_id, item, body, now))
        except DomainError as exc:
            parsed.append(Rejected(item["event_id"], exc))
    return parsed


_Lists = TypeAdapter[list[RankEventBody]] | TypeAdapter[list[ScalarEventBody]]
_LISTS: dict[EventKind, _Lists] = {}


def _list_of(kind: EventKind) -> _Lists:
    """Each kind's bodies as a list, validated in one call (a fifth less time than a call per event);
    built on first use, as the models are (``defer_build``)."""
    adapter = _LISTS.get(kind)
    if adapter is None:
        made: _Lists = (
            TypeAdapter(list[ScalarEventBody]) if kind is ScalarEvent else TypeAdapter(list[RankEventBody])
        )
        adapter = _LISTS[kind] = made
    return adapter


def _validated_all(
    kind: EventKind, items: list[dict[str, Any]]
) -> Sequence[RankEventBody | ScalarEventBody | InvalidInput]:
    """Each event's body, or the error that refuses it: all at once while they are valid, one by one
    (naming each event's own faults) once one is not."""
    try:
        return _list_of(kind).validate_python(items)
    except ValidationError:
        return [_validated(kind, item) for item in items]


def _validated(kind: EventKind, item: dict[str, Any]) -> RankEventBody | ScalarEventBody | InvalidInput:
    try:
        return _validate(kind, item)
    except InvalidInput as exc:
        return exc


def _batch_events(document: Any) -> list[dict[str, Any]]:
    """The ``events`` list of a batch, each with a valid ``event_id`` unique in the batch, and no other
    field beside it (as a single event refuses fields it does not know)."""
    unknown = [key for key in document if key != "events"] if isinstance(document, dict) else []
    if unknown:
        shown = [k.encode("utf-8", "backslashreplace").decode() for k in unknown[:MAX_DETAILS]]
        more = f" (and {len(unknown) - MAX_DETAILS:,} more)" if len(unknown) > MAX_DETAILS else ""
        raise InvalidInput(
            f"a batch body has only 'events'; unknown field {shown[0]!r}{more}",
            [FieldError(name, "is not a field of a batch (only 'events')") for name in shown],
        )
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
                    f"is required in a batch and must be {limits.EVENT_ID_RULE}",
                )
            )
        elif first_index.setdefault(event_id, i) != i:
            # Two events under one id in one request cannot both be right; which one would win
            # would depend on the order of concurrent puts. The whole request is refused.
            problems.append(FieldError(f"events.{i}.event_id", f"repeats events.{first_index[event_id]}"))
    if problems:
        raise InvalidInput(f"{problems[0].field} {problems[0].message}", problems)
    return events


def _batch_event(
    project: str,
    run_id: str,
    item: dict[str, Any],
    body: RankEventBody | ScalarEventBody | InvalidInput,
    now: float,
) -> Event:
    # The 64 KiB limit applies to each event as compact JSON, however the batch was formatted.
    # Serializing every event to measure it would cost a third of a batch's time; a valid event is
    # far below the limit by a bound that needs no serializing. An invalid one is measured before it
    # is refused, so an event over the limit is refused for its size, as a single event is.
    if isinstance(body, InvalidInput):
        _check_size(item)
        raise body
    if _size_bound(item) > limits.MAX_EVENT_BYTES:
        _check_size(item)
    return to_event(project, run_id, body, item["event_id"], now)


#: A bound on the compact JSON of any valid event's fields other than its metrics and event id.
_FIXED_FIELDS_BYTES = 512
_SHORT_VALUE_BYTES = 32  # a float's repr, "-Infinity" or a bounded int, with quotes and separators
_SHORT_METRIC_TYPES = {float, str}  # the non-finite strings


def _size_bound(item: dict[str, Any]) -> int:
    """An upper bound of a *valid* event's compact JSON size in bytes, or a huge number when it has
    none that is cheap to know (then the size is measured). Validation bounds every field (no other
    field, ids and keys of bounded length, ints and times within limits) except an int given for a
    float: a weight or a metric value may be an int of any length."""
    metrics = item["metrics"]
    if not set(map(type, metrics.values())) <= _SHORT_METRIC_TYPES and not all(
        type(v) is not int or -(10**18) < v < 10**18 for v in metrics.values()
    ):
        return _UNKNOWN
    weight = item.get("weight")
    if type(weight) is int and not -(10**18) < weight < 10**18:
        return _UNKNOWN
    # A character is at most 6 bytes (a \u escape); per key, quotes, colon and comma and a short value.
    keys = sum(map(len, metrics))
    per_key = 8 + _SHORT_VALUE_BYTES
    return _FIXED_FIELDS_BYTES + 6 * len(item["event_id"]) + 6 * keys + per_key * len(metrics)


_UNKNOWN = 1 << 62


def _check_size(item: dict[str, Any]) -> None:
    size = len(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(
            f"an event may be at most {limits.MAX_EVENT_BYTES} bytes as compact JSON, got {size}",
            [FieldError("body", f"must be at most {limits.MAX_EVENT_BYTES} bytes")],
        )


#: What ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` does, built once rather than per
#: event. The digests of stored events depend on these exact bytes: never change them.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
#: The digested fields, in the order ``sort_keys`` writes them.
_DIGEST_FIELDS = tuple(sorted(name for name in RankEventBody.model_fields if name != "event_id"))
_SCALAR_DIGEST_FIELDS = tuple(sorted(name for name in ScalarEventBody.model_fields if name != "event_id"))
if _DIGEST_FIELDS != ("local_rank", "metrics", "rank", "step", "time", "weight", "world_size") or (
    _SCALAR_DIGEST_FIELDS != ("metrics", "rank", "step", "time")
):
    raise RuntimeError("canonical_json writes the digested fields by name: add the new field there")
_json_string = json.encoder.encode_basestring_ascii  # how the canonical encoder writes a str


def canonical_json(body: RankEventBody | ScalarEventBody) -> str:
    """``_CANONICAL_JSON.encode`` of the body's digested fields, byte for byte, written without the
    encoder's per-call set-up (a third of an event's ingest time). A validated body holds ints, finite
    floats, None, the non-finite strings and a dict of metrics, and JSON writes an int or a finite float
    as its ``repr``; tests/unit/test_digest.py holds the two equal."""
    metrics = ",".join(
        [
            f"{_json_string(key)}:{value!r}"
            if type(value) is float
            else f'{_json_string(key)}:"{value}"'  # "NaN", "Infinity" or "-Infinity"
            for key, value in sorted(body.metrics.items())
        ]
    )
    time = "null" if body.time is None else repr(body.time)
    if isinstance(body, ScalarEventBody):
        return f'{{"metrics":{{{metrics}}},"rank":{body.rank!r},"step":{body.step!r},"time":{time}}}'
    local_rank = "null" if body.local_rank is None else repr(body.local_rank)
    return (
        f'{{"local_rank":{local_rank},"metrics":{{{metrics}}},"rank":{body.rank!r},"step":{body.step!r},'
        f'"time":{time},"weight":{body.weight!r},"world_size":{body.world_size!r}}}'
    )


@overload
def to_event(
    project: str, run_id: str, body: RankEventBody, event_id: str | None, now: float
) -> RankEvent: ...
@overload
def to_event(
    project: str, run_id: str, body: ScalarEventBody, event_id: str | None, now: float
) -> ScalarEvent: ...
def to_event(
    project: str, run_id: str, body: RankEventBody | ScalarEventBody, event_id: str | None, now: float
) -> Event:
    """The stored form of a validated body: a ``RankEventBody`` makes a :class:`RankEvent`, a
    ``ScalarEventBody`` a :class:`ScalarEvent`. A missing event id gets a fresh server-side one."""
    # The digest covers what the client sent, so a retry of the same request matches itself even
    # when the server fills in a missing time or event id.
    digest = hashlib.blake2b(canonical_json(body).encode(), digest_size=16).digest()
    # A validated value is a number or one of limits.NONFINITE_STRINGS, which float() reads as they are.
    values = tuple(map(float, body.metrics.values()))
    event_id = event_id or _new_event_id()
    time = now if body.time is None else float(body.time)
    if isinstance(body, ScalarEventBody):
        return ScalarEvent(
            project, run_id, event_id, body.step, body.rank, time, tuple(body.metrics), values, digest
        )
    return RankEvent(
        project=project,
        run_id=run_id,
        event_id=event_id,
        step=body.step,
        rank=body.rank,
        world_size=body.world_size,
        local_rank=body.local_rank,
        weight=float(body.weight),
        time=time,
        keys=tuple(body.metrics),
        values=values,
        payload_digest=digest,
    )


def _new_event_id() -> str:
    import uuid

    return f"srv-{uuid.uuid4().hex}"
