"""The request bodies of the write routes as pydantic models, checked against the contract's limits
(``instantml.limits``), and their validation into contract errors naming every bad field. The routes'
schemas (``infra.openapi``) are generated from the same models."""

from __future__ import annotations

import re
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
    model_validator,
)

from instantml import limits
from shared.errors import FieldError, InvalidInput

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


#: A process record's texts (contract 8): exception type and message line, a frame, a thread's name.
ProcessText = Annotated[str, Field(max_length=limits.MAX_PROCESS_TEXT)]


class ExceptionBody(BaseModel):
    """How an exception ended a process: its type, its message's first line, the user's innermost frame."""

    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    type: ProcessText
    message: ProcessText = ""
    where: ProcessText | None = None
    thread: ProcessText | None = None  # (a thread that died: in a beat's ``thread_failure``)


class ProcessBody(BaseModel):
    """``process`` of a run update (contract 8): a process's ``started`` or ``ended`` record, or a beat
    of a process whose main thread is silent (with its stack)."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", defer_build=True)

    state: Literal["started", "beat", "ended"]
    world_size: int = Field(ge=1, le=limits.MAX_WORLD_SIZE)
    rank: int = Field(ge=0, lt=limits.MAX_WORLD_SIZE)
    local_rank: int | None = Field(default=None, ge=0, lt=limits.MAX_WORLD_SIZE)
    pid: int = Field(ge=0, le=2**31)
    attempt: int = Field(default=0, ge=0, le=1_000_000)
    host: Annotated[str, AfterValidator(_host)] | None = None
    first_step: int | None = Field(default=None, ge=0, le=limits.MAX_STEP)
    step: int | None = Field(default=None, ge=0, le=limits.MAX_STEP)
    #: ``vanished``: the spool's uploader reports a writer gone without an end of its own (SIGKILL).
    how: Literal["finished", "exception", "signal", "exit", "vanished"] | None = None
    exception: ExceptionBody | None = None
    signal: Annotated[str, Field(max_length=32)] | None = None
    code: int | None = Field(default=None, ge=-(2**31), le=2**31)
    silent_s: FiniteFloat | None = Field(default=None, ge=0)
    every: FiniteFloat | None = Field(default=None, gt=0, le=86_400)  # a beat's interval (INSTANTML_BEAT_S)
    stack: list[ProcessText] | None = Field(default=None, max_length=64)
    thread_failure: ExceptionBody | None = None

    @field_validator("rank", "local_rank")
    @classmethod
    def _below_world_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        world_size = info.data.get("world_size")
        if value is not None and world_size is not None and value >= world_size:
            raise ValueError(f"must be < world_size ({world_size}), got {value}")
        return value

    @model_validator(mode="after")
    def _ended_says_how(self) -> ProcessBody:
        if (self.state == "ended") != (self.how is not None):
            raise ValueError(
                "how: an 'ended' record says how it ended ('finished', 'exception', 'signal', 'exit', "
                "'vanished'); "
                "no other record does"
            )
        return self

    @field_validator("stack")
    @classmethod
    def _stack_size(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and sum(len(line.encode()) for line in value) > limits.MAX_STACK_BYTES:
            raise ValueError(f"must be at most {limits.MAX_STACK_BYTES} bytes of frames")
        return value


class RunUpdateBody(BaseModel):
    """The JSON body of ``PATCH .../runs/{run_id}``: the run's config, its end, and/or the hosts of some
    of its ranks (``{"3": "gpu-node-07"}``: each process says its own once, at ``im.init``)."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", defer_build=True)

    config: dict[str, Any] | None = None
    status: Literal["finished"] | None = None
    hosts: Hosts | None = None
    process: ProcessBody | None = None
    time: FiniteFloat | None = Field(default=None, ge=0, le=limits.MAX_TIME)


Body = TypeVar("Body", bound=BaseModel)


def field_errors(exc: ValidationError) -> list[FieldError]:
    """pydantic's errors as contract ``details``: a dotted field path and one sentence each."""
    details = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(part) for part in error["loc"]) or "body"
        details.append(FieldError(path, error["msg"].removeprefix("Value error, ")))
    return details


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
