"""The domain: what a rank event is, validated with the contract's limits (``instantml.limits``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from instantml import limits

MetricKey = Annotated[str, StringConstraints(pattern=limits.KEY_PATTERN)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MetricValue = FiniteFloat | Literal["NaN", "Infinity", "-Infinity"]
EventId = Annotated[str, StringConstraints(pattern=limits.EVENT_ID_PATTERN)]


class RankEventBody(BaseModel):
    """The JSON body of ``POST .../rank-metrics`` (contract 3.3), checked against contract 3.4."""

    # strict: booleans are not numbers and "1.5" is not a number; forbid: a misspelt field is an
    # error the user sees, not a value silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")

    event_id: EventId | None = None
    step: int = Field(ge=0, le=limits.MAX_STEP)
    world_size: int = Field(ge=1, le=limits.MAX_WORLD_SIZE)
    rank: int = Field(ge=0, lt=limits.MAX_WORLD_SIZE)
    local_rank: int | None = Field(default=None, ge=0, lt=limits.MAX_WORLD_SIZE)
    weight: FiniteFloat = Field(default=1.0, ge=0)
    metrics: dict[MetricKey, MetricValue] = Field(min_length=1, max_length=limits.MAX_KEYS_PER_EVENT)
    time: FiniteFloat | None = Field(default=None, ge=0)

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

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")

    event_id: EventId | None = None
    step: int = Field(ge=0, le=limits.MAX_STEP)
    rank: int = Field(default=0, ge=0, lt=limits.MAX_WORLD_SIZE)
    metrics: dict[MetricKey, MetricValue] = Field(min_length=1, max_length=limits.MAX_KEYS_PER_EVENT)
    time: FiniteFloat | None = Field(default=None, ge=0)


class RunUpdateBody(BaseModel):
    """The JSON body of ``PATCH .../runs/{run_id}``: the run's config and/or its end."""

    model_config = ConfigDict(extra="forbid", strict=True)

    config: dict[str, Any] | None = None
    status: Literal["finished"] | None = None
    time: FiniteFloat | None = Field(default=None, ge=0)


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


@dataclass(frozen=True, slots=True)
class FieldError:
    field: str
    message: str


class DomainError(Exception):
    """Base of the errors the logic raises; ``code`` is the contract's machine code (3.2)."""

    code = "invalid_request"

    def __init__(self, message: str, details: list[FieldError] | None = None) -> None:
        super().__init__(message)
        self.details = details or []

    def error_object(self) -> dict[str, Any]:
        """The contract's ``error`` object: code, one sentence, and the fields at fault."""
        error: dict[str, Any] = {"code": self.code, "message": str(self)}
        if self.details:
            error["details"] = [{"field": d.field, "message": d.message} for d in self.details]
        return error


class InvalidInput(DomainError):
    """The request is outside the contract (3.4); ``details`` name the fields at fault."""


class NotFound(DomainError):
    """There is nothing at this path (for example a run with no events)."""

    code = "not_found"


class PayloadTooLarge(DomainError):
    """A body is larger than the contract allows."""

    code = "payload_too_large"


class EventIdReused(DomainError):
    """The event id is stored with a different payload."""

    code = "idempotency_key_reused"


class StoreUnavailable(DomainError):
    """The store is failing or timing out; the client should retry after ``retry_after`` s.

    Every write is a conditional put, so a retry of the whole request is always safe: what was
    stored before the failure answers ``duplicate`` the second time.
    """

    code = "unavailable"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreThrottled(StoreUnavailable):
    """The store is throttling writes: ``429 rate_limited`` with ``Retry-After``."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message, retry_after)


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


def parse_json(raw: bytes | str) -> Any:
    """A request body as JSON, strictly: ``NaN``/``Infinity`` literals, bad UTF-8 and nesting deeper
    than :data:`MAX_JSON_DEPTH` are errors (``InvalidInput`` naming ``body``), never a crash."""
    try:
        document = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidInput(f"body is not valid JSON: {exc}", [FieldError("body", "must be JSON")]) from None
    except RecursionError:  # thousands of '[' or '{': the decoder gives up before the end
        raise _too_deep() from None
    if _nests_deeper_than(document, raw, MAX_JSON_DEPTH):
        raise _too_deep()
    return document


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
    project: str, run_id: str, raw: bytes | str, event_id: str | None, now: float, scalar: bool
) -> RankEvent:
    """One rank event body (or, with ``scalar``, one ``run.log`` event body) as a :class:`RankEvent`."""
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


#: What ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` does, built once rather than per
#: event. The digests of stored events depend on these exact bytes: never change them.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_DIGEST_FIELDS = tuple(name for name in RankEventBody.model_fields if name != "event_id")
_SCALAR_DIGEST_FIELDS = tuple(name for name in ScalarEventBody.model_fields if name != "event_id")


def to_rank_event(
    project: str, run_id: str, body: RankEventBody | ScalarEventBody, event_id: str | None, now: float
) -> RankEvent:
    """The stored form of a validated body; a ``run.log`` body (``ScalarEventBody``) becomes a rank event
    of world size 0 and weight 1. A missing event id gets a fresh server-side one."""
    # The digest covers what the client sent, so a retry of the same request matches itself even
    # when the server fills in a missing time or event id.
    scalar = isinstance(body, ScalarEventBody)
    fields = _SCALAR_DIGEST_FIELDS if scalar else _DIGEST_FIELDS
    canonical = {name: getattr(body, name) for name in fields}  # model_dump's values, faster
    digest = hashlib.blake2b(_CANONICAL_JSON.encode(canonical).encode(), digest_size=16).digest()
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


def check_path(project: str, run_id: str | None) -> None:
    """The names in a path (``run_id`` None: a project's route, such as its runs)."""
    details = [
        FieldError(
            name, f"must be 1-{limits.MAX_NAME_LENGTH} of A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
        for name, value in (("project", project), ("run_id", run_id))
        if not limits.is_valid_name(value) and not (name == "run_id" and value is None)
    ]
    if details:
        raise InvalidInput(f"{details[0].field} {details[0].message}", details)
