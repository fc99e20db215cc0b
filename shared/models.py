"""The domain: what a rank event is, validated with the contract's limits (``instantml.limits``)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from instantml import limits

# The errors live in shared.errors (no pydantic); their names stay importable from here too (__all__).
from shared.errors import (
    DomainError,
    EventIdReused,
    FieldError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    StoreThrottled,
    StoreUnavailable,
    check_path,
)

__all__ = [
    "DomainError",
    "EventIdReused",
    "FieldError",
    "InvalidInput",
    "NotFound",
    "PayloadTooLarge",
    "StoreThrottled",
    "StoreUnavailable",
    "check_path",
]


#: Metric keys already found valid: a run logs the same few keys in every event, and a set lookup
#: costs a tenth of the check. Bounded, so a client sending ever new keys only fills it once.
_VALID_KEYS: set[str] = set()
_VALID_KEYS_KEPT = 4096


def _metric_key(value: str) -> str:
    if value in _VALID_KEYS:
        return value
    if not limits.is_valid_key(value):
        raise ValueError(
            f"must be 1-{limits.MAX_KEY_LENGTH} printable characters without control characters or "
            "leading/trailing spaces"
        )
    if len(_VALID_KEYS) < _VALID_KEYS_KEPT:
        _VALID_KEYS.add(value)
    return value


def _event_id(value: str) -> str:
    if not limits.is_valid_event_id(value):
        raise ValueError(f"must be {limits.EVENT_ID_RULE}")
    return value


# The rules are checked by limits' own functions (``fullmatch``: a pydantic ``pattern=`` would let a
# trailing newline through, as Python's ``$`` matches before one); the schema shows the same patterns.
MetricKey = Annotated[
    str, AfterValidator(_metric_key), WithJsonSchema({"type": "string", "pattern": limits.KEY_PATTERN})
]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MetricValue = FiniteFloat | Literal["NaN", "Infinity", "-Infinity"]
EventId = Annotated[
    str, AfterValidator(_event_id), WithJsonSchema({"type": "string", "pattern": limits.EVENT_ID_PATTERN})
]
#: A rank as a JSON object's key: 0-511 (``limits.MAX_WORLD_SIZE`` - 1) in decimal, no leading zero.
RANK_TEXT_PATTERN = r"^(0|[1-9][0-9]?|[1-4][0-9]{2}|50[0-9]|51[01])$"
_RANK_TEXT = re.compile(RANK_TEXT_PATTERN)
assert limits.MAX_WORLD_SIZE == 512, "RANK_TEXT_PATTERN spells out 0-511"


def _rank_text(value: str) -> str:
    if _RANK_TEXT.fullmatch(value) is None:
        raise ValueError(f"must be a rank as a decimal string, 0-{limits.MAX_WORLD_SIZE - 1}, got {value!r}")
    return value


def _host(value: str) -> str:
    if not limits.is_valid_host(value):
        raise ValueError(f"must be 1-{limits.MAX_HOST_LENGTH} printable ASCII characters without spaces")
    return value


#: ``hosts`` of a run update: ranks (a JSON object's keys, so decimal strings) and their hosts' names.
Hosts = Annotated[
    dict[Annotated[str, AfterValidator(_rank_text)], Annotated[str, AfterValidator(_host)]],
    Field(min_length=1, max_length=limits.MAX_WORLD_SIZE),
    WithJsonSchema(
        {
            "type": "object",
            "minProperties": 1,
            "maxProperties": limits.MAX_WORLD_SIZE,
            "propertyNames": {"pattern": RANK_TEXT_PATTERN},
            "additionalProperties": {"type": "string", "pattern": limits.HOST_PATTERN},
        }
    ),
]


class RankEventBody(BaseModel):
    """The JSON body of ``POST .../rank-metrics`` (contract 3.3), checked against contract 3.4."""

    # strict: booleans are not numbers and "1.5" is not a number; forbid: a misspelt field is an
    # error the user sees, not a value silently dropped. defer_build: each model's validator is built
    # when first used, not at import: a cold start builds only the models its route validates.
    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", defer_build=True)

    event_id: EventId | None = None
    step: int = Field(ge=0, le=limits.MAX_STEP)
    world_size: int = Field(ge=1, le=limits.MAX_WORLD_SIZE)
    rank: int = Field(ge=0, lt=limits.MAX_WORLD_SIZE)
    local_rank: int | None = Field(default=None, ge=0, lt=limits.MAX_WORLD_SIZE)
    weight: FiniteFloat = Field(default=1.0, ge=0)
    metrics: dict[MetricKey, MetricValue] = Field(min_length=1, max_length=limits.MAX_KEYS_PER_EVENT)
    time: FiniteFloat | None = Field(default=None, ge=0, le=limits.MAX_TIME)

    @field_validator("rank", "local_rank")
    @classmethod
    def _below_world_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        # world_size is declared first, so it is validated (or missing) by now.
        world_size = info.data.get("world_size")
        if value is not None and world_size is not None and value >= world_size:
            raise ValueError(f"must be < world_size ({world_size}), got {value}")
        return value


class ScalarEventBody(BaseModel):
    """The JSON body of ``POST .../scalars`` (``run.log``): a rank event without a world or a weight."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", defer_build=True)

    event_id: EventId | None = None
    step: int = Field(ge=0, le=limits.MAX_STEP)
    rank: int = Field(default=0, ge=0, lt=limits.MAX_WORLD_SIZE)
    metrics: dict[MetricKey, MetricValue] = Field(min_length=1, max_length=limits.MAX_KEYS_PER_EVENT)
    time: FiniteFloat | None = Field(default=None, ge=0, le=limits.MAX_TIME)


class RunUpdateBody(BaseModel):
    """The JSON body of ``PATCH .../runs/{run_id}``: the run's config, its end, and/or the hosts of some
    of its ranks (``{"3": "gpu-node-07"}``: each process says its own once, at ``im.init``)."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", defer_build=True)

    config: dict[str, Any] | None = None
    status: Literal["finished"] | None = None
    hosts: Hosts | None = None
    time: FiniteFloat | None = Field(default=None, ge=0, le=limits.MAX_TIME)


@dataclass(frozen=True, slots=True)
class RankEvent:
    """One rank's metric batch for one global step, as stored; a ``run.log`` scalar event is one with
    ``world_size`` 0, no local rank and weight 1."""

    project: str
    run_id: str
    event_id: str
    step: int
    rank: int
    world_size: int
    local_rank: int | None
    weight: float
    time: float
    keys: tuple[str, ...]
    values: tuple[float, ...]
    #: Digest of what the client sent: tells a retry (same digest) from a reused id (another one).
    payload_digest: bytes


Body = TypeVar("Body", bound=BaseModel)


def field_errors(exc: ValidationError) -> list[FieldError]:
    """pydantic's errors as contract ``details``: a dotted field path and one sentence each."""
    details = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"]) or "body"
        details.append(FieldError(path, error["msg"].removeprefix("Value error, ")))
    return details


#: How deeply a request body may nest arrays and objects. A batch needs 3 levels (body, events, an
#: event's metrics); the bound is far above that and far below what any recursive code can take.
MAX_JSON_DEPTH = 64


def parse_json(raw: bytes | str, check_text: bool = True) -> Any:
    """A request body as JSON, strictly: ``NaN``/``Infinity`` literals, bad UTF-8 and nesting deeper
    than :data:`MAX_JSON_DEPTH` are errors (``InvalidInput`` naming ``body``), never a crash.

    With ``check_text``, a string (or object key) that UTF-8 cannot encode is an error naming its field
    (:func:`check_text`); a batch checks each of its events on its own instead."""
    try:
        document = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidInput(f"body is not valid JSON: {exc}", [FieldError("body", "must be JSON")]) from None
    except RecursionError:  # thousands of '[' or '{': the decoder gives up before the end
        raise _too_deep() from None
    if _nests_deeper_than(document, raw, MAX_JSON_DEPTH):
        raise _too_deep()
    if check_text and may_hold_surrogates(raw):
        check_text_of(document)
    return document


#: A JSON escape of a UTF-16 surrogate (``\ud800``-``\udfff``), or a surrogate encoded as UTF-8 would
#: encode one (``ED A0``-``ED BF``, which strict UTF-8 refuses but ``json.loads`` decodes bytes with
#: "surrogatepass"): both become lone surrogates in the document.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def may_hold_surrogates(raw: bytes | str) -> bool:
    """Whether a JSON text may parse to a string with a lone surrogate: it escapes a surrogate (most
    often half of a pair, as ``json.dumps`` writes an emoji) or, as text, is not ASCII."""
    if isinstance(raw, bytes):
        return _SURROGATE_ESCAPE.search(raw) is not None
    return not raw.isascii() or _SURROGATE_ESCAPE_TEXT.search(raw) is not None


#: How many fields at fault an error names.
MAX_DETAILS = 5


def check_text_of(document: Any) -> None:
    """Refuse a document holding a string or key that UTF-8 cannot encode (a lone surrogate): every
    store and byte stream would fail on it later. ``InvalidInput`` names the first few such fields."""
    try:
        json.dumps(document, ensure_ascii=False, check_circular=False).encode()
        return
    except UnicodeEncodeError:
        pass
    message = "must be valid Unicode text: it holds a lone surrogate, which UTF-8 cannot encode"
    details = [FieldError(path, message) for path in _surrogate_paths(document)]
    raise InvalidInput(f"{details[0].field} {message}", details)


def _surrogate_paths(document: Any) -> list[str]:
    """The dotted paths (as pydantic names fields) of the first few strings or keys that UTF-8 cannot
    encode; a bad key is shown with its surrogates as ``\\u`` escapes, so the answer itself encodes."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", document)]
    while stack and len(found) < MAX_DETAILS:
        path, node = stack.pop()
        if isinstance(node, str):
            if not limits.is_utf8_text(node):
                found.append(path or "body")
        elif isinstance(node, dict):
            children = []
            for key, value in node.items():
                shown = key if limits.is_utf8_text(key) else key.encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{shown}" if path else shown
                if shown is not key:
                    found.append(child)
                children.append((child, value))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend(reversed([(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node)]))
    return found[:MAX_DETAILS]


def _too_deep() -> InvalidInput:
    message = f"must nest at most {MAX_JSON_DEPTH} levels of arrays and objects"
    return InvalidInput(f"body {message}", [FieldError("body", message)])


def _nests_deeper_than(document: Any, raw: bytes | str, limit: int) -> bool:
    """Whether a parsed document has more than ``limit`` levels of containers, without recursion.

    Every container starts with a bracket, so a body with few brackets is shallow: only those with
    more (a batch, an attack) are walked, one level at a time.
    """
    brackets = (
        raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
    )
    if brackets <= limit:
        return False
    # json.loads makes exact dicts and lists: `type(x) is` is several times faster than isinstance.
    level = [document] if type(document) is dict or type(document) is list else []
    for _ in range(limit):
        inner: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    inner.append(child)
        if not inner:
            return False
        level = inner
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f'{name} is not JSON; send non-finite metric values as the string "{name}"')


def validate(model: type[Body], document: Any, what: str = "rank event") -> Body:
    """A parsed JSON document as ``model``; ``InvalidInput`` names every bad field."""
    try:
        # JSON numbers arrive as int or float; 1e309 arrives as inf and fails the finite check.
        return model.model_validate(document)
    except ValidationError as exc:
        details = field_errors(exc)
        first = details[0] if details else FieldError("body", f"is not a valid {what}")
        raise InvalidInput(f"{first.field}: {first.message}", details) from None


def validate_body(document: Any) -> RankEventBody:
    """A parsed JSON document as a :class:`RankEventBody`; ``InvalidInput`` names every bad field."""
    return validate(RankEventBody, document)


def validate_scalar_body(document: Any) -> ScalarEventBody:
    return validate(ScalarEventBody, document, "scalar event")


def parse_event(
    project: str, run_id: str, raw: bytes, idempotency_key: str | None, now: float, scalar: bool
) -> RankEvent:
    """One rank event request (or, with ``scalar``, one ``run.log`` event request) as a :class:`RankEvent`:
    its size, JSON, fields and ``Idempotency-Key`` header checked."""
    if len(raw) > limits.MAX_EVENT_BYTES:
        raise PayloadTooLarge(
            f"an event body may be at most {limits.MAX_EVENT_BYTES} bytes, got {len(raw)}",
            [FieldError("body", f"must be at most {limits.MAX_EVENT_BYTES} bytes")],
        )
    event_id = unquote_idempotency_key(idempotency_key)
    document = parse_json(raw)
    body: RankEventBody | ScalarEventBody = (
        validate_scalar_body(document) if scalar else validate_body(document)
    )
    if event_id is not None and body.event_id is not None and body.event_id != event_id:
        raise InvalidInput(
            "event_id in the body does not match the Idempotency-Key header",
            [FieldError("event_id", "must equal the Idempotency-Key header")],
        )
    return to_rank_event(project, run_id, body, event_id or body.event_id, now)


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


def parse_batch(
    project: str, run_id: str, raw: bytes, now: float, scalar: bool
) -> list[RankEvent | Rejected]:
    """A batch request's events, in order, each parsed or rejected on its own. Whole-request problems
    (size, JSON, shape, a missing or repeated ``event_id``) raise: nothing of such a batch is stored."""
    if len(raw) > limits.MAX_BATCH_BYTES:
        raise PayloadTooLarge(
            f"a batch may be at most {limits.MAX_BATCH_BYTES} bytes, got {len(raw)}",
            [FieldError("body", f"must be at most {limits.MAX_BATCH_BYTES} bytes")],
        )
    parsed: list[RankEvent | Rejected] = []
    check_text = may_hold_surrogates(raw)
    for item in _batch_events(parse_json(raw, check_text=False)):
        try:
            if check_text:
                check_text_of(item)
            parsed.append(_batch_event(project, run_id, item, now, scalar))
        except DomainError as exc:
            parsed.append(Rejected(item["event_id"], exc))
    return parsed


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


def _batch_event(project: str, run_id: str, item: dict[str, Any], now: float, scalar: bool) -> RankEvent:
    # The 64 KiB limit applies to each event as compact JSON, however the batch was formatted.
    # Serializing every event to measure it would cost a third of a batch's time; a valid event is
    # far below the limit by a bound that needs no serializing. An invalid one is measured before it
    # is refused, so an event over the limit is refused for its size, as a single event is.
    try:
        body = validate_scalar_body(item) if scalar else validate_body(item)
    except InvalidInput:
        _check_size(item)
        raise
    if _size_bound(item) > limits.MAX_EVENT_BYTES:
        _check_size(item)
    return to_rank_event(project, run_id, body, item["event_id"], now)


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


def to_rank_event(
    project: str, run_id: str, body: RankEventBody | ScalarEventBody, event_id: str | None, now: float
) -> RankEvent:
    """The stored form of a validated body; a ``run.log`` body (``ScalarEventBody``) becomes a rank event
    of world size 0 and weight 1. A missing event id gets a fresh server-side one."""
    # The digest covers what the client sent, so a retry of the same request matches itself even
    # when the server fills in a missing time or event id.
    scalar = isinstance(body, ScalarEventBody)
    digest = hashlib.blake2b(canonical_json(body).encode(), digest_size=16).digest()
    values = tuple(
        limits.NONFINITE_STRINGS[v] if isinstance(v, str) else float(v) for v in body.metrics.values()
    )
    return RankEvent(
        project=project,
        run_id=run_id,
        event_id=event_id or _new_event_id(),
        step=body.step,
        rank=body.rank,
        world_size=0 if scalar else body.world_size,  # type: ignore[union-attr]
        local_rank=None if scalar else body.local_rank,  # type: ignore[union-attr]
        weight=1.0 if scalar else float(body.weight),  # type: ignore[union-attr]
        time=now if body.time is None else float(body.time),
        keys=tuple(body.metrics),
        values=values,
        payload_digest=digest,
    )


def _new_event_id() -> str:
    import uuid

    return f"srv-{uuid.uuid4().hex}"
