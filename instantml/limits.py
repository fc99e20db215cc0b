"""The limits of contract section 3.4, defined once for the client and the server.

Pure Python with no dependencies: the client checks them in the training process before anything
is written, and the server's request bodies (``shared/ingest/bodies.py``) build their validation from the same
numbers and the same name and key rules.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_WORLD_SIZE = 512
MAX_STEP = 2**53 - 1
MAX_KEYS_PER_EVENT = 256
MAX_KEY_LENGTH = 256
MAX_NAME_LENGTH = 128
MAX_EVENT_BYTES = 64 * 1024
MAX_BATCH_EVENTS = 1000
MAX_BATCH_BYTES = 5 * 1024 * 1024
MAX_IDEMPOTENCY_KEY_LENGTH = 255
#: ``im.init(config=...)``: a JSON object of at most this many bytes as compact JSON.
MAX_CONFIG_BYTES = 64 * 1024
#: A process record (contract 8): each of its texts (exception type and message line, a frame, a host)
#: at most ``MAX_PROCESS_TEXT`` characters, its stack at most ``MAX_STACK_BYTES`` as ``file:line function``
#: lines.
MAX_PROCESS_TEXT = 300
MAX_STACK_BYTES = 4096

#: How the uploaders batch (both the in-process one and the spool's background uploader): a rank's
#: events wait and go as one batch request once the first of these bounds is reached:
#:
#: - time: the oldest waiting event has waited ``UPLOAD_LINGER_S``;
#: - size: ``batch_size`` events wait (``im.init``, default 500, at most ``MAX_BATCH_EVENTS``), or, in
#:   spool mode, ``UPLOAD_BATCH_BYTES`` of spool lines (about 1,000 events of 4 keys);
#: - the end: ``finish``, a process's exit, or a spool file whose writer is gone sends what waits at once,
#:   and so does every request until the server has taken one (a wrong URL or token shows at once).
#:
#: A request costs on AWS whatever it carries (API Gateway, a Lambda invocation, its logs): one request
#: per rank per step was 512 to 2,560 requests/s for a 512-rank job. With 10 s, such a job sends about
#: 51 requests/s at any step rate up to 50 steps/s, each of 10 events per step per second
#: (``benchmarks/aws_model.py``), and the Distributed tab shows a step up to 10 s after it was logged.
#: A server on this machine (``instantml local``, a loopback URL) takes ``UPLOAD_LINGER_LOCAL_S``: a
#: request costs nothing there, and the live tab wants the newest steps. ``INSTANTML_LINGER_S`` sets
#: either.
UPLOAD_LINGER_S = 10.0
UPLOAD_LINGER_LOCAL_S = 0.25
#: A job's first uploads to a deployed server come at about ``FIRST_UPLOADS_PER_S`` a second: each
#: thread uploader waits a random part of ``world_size / FIRST_UPLOADS_PER_S`` seconds (at most
#: ``FIRST_UPLOAD_SPREAD_MAX_S``) before its first request, so a 512-rank job's first requests meet the
#: cold Lambda instances and the authorizer's first verdict over 5 s instead of all at once (that burst
#: had 19.5% of the first minute's requests throttled, 0.2% with it: ``benchmarks/aws_model.py``).
#: No spread for a server on this machine, a single process or a job of unknown size.
FIRST_UPLOADS_PER_S = 100.0
FIRST_UPLOAD_SPREAD_MAX_S = 10.0
UPLOAD_BATCH_BYTES = 256 * 1024

#: Non-finite metric values travel as these JSON strings (JSON has no NaN or Infinity).
NONFINITE_STRINGS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

#: The patterns below are published as they are in ``openapi.json`` (JSON Schema's dialect, where ``$``
#: ends the input). In Python ``$`` also matches before a trailing newline, so they are only ever
#: applied with ``fullmatch`` (:func:`is_valid_name`, :func:`is_valid_key`, :func:`is_valid_event_id`):
#: never with ``re.match`` or ``re.search``, nor as a pydantic ``pattern=``.
#:
#: project and run_id: 1-``MAX_NAME_LENGTH`` of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit.
NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_LENGTH - 1}}}$"
#: metric keys: 1-``MAX_KEY_LENGTH`` printable characters, no control characters, no leading or trailing
#: space.
KEY_PATTERN = rf"^(?! )[^\x00-\x1f\x7f-\x9f]{{1,{MAX_KEY_LENGTH}}}(?<! )$"
#: Idempotency-Key / event_id: 1-``MAX_IDEMPOTENCY_KEY_LENGTH`` printable ASCII characters, the first not
#: a space.
EVENT_ID_PATTERN = rf"^[\x21-\x7e][\x20-\x7e]{{0,{MAX_IDEMPOTENCY_KEY_LENGTH - 1}}}$"
#: What an Idempotency-Key or event_id must be, for error messages.
EVENT_ID_RULE = f"1-{MAX_IDEMPOTENCY_KEY_LENGTH} printable ASCII characters"
#: A rank's host (``PATCH .../runs/{run_id}``'s ``hosts``, from ``socket.gethostname()``): 1-
#: ``MAX_HOST_LENGTH`` printable ASCII characters without spaces.
MAX_HOST_LENGTH = 255
HOST_PATTERN = rf"^[\x21-\x7e]{{1,{MAX_HOST_LENGTH}}}$"

_NAME_RE = re.compile(NAME_PATTERN)
_KEY_RE = re.compile(KEY_PATTERN)
_EVENT_ID_RE = re.compile(EVENT_ID_PATTERN)
_HOST_RE = re.compile(HOST_PATTERN)

#: ``time`` of an event or a run update: seconds since the epoch, from 0 to 2200-01-01T00:00:00Z.
#: A clock that far off is broken, and a bound keeps every later sum of times finite.
MAX_TIME = 7_258_118_400.0


class LimitError(ValueError):
    """An argument is outside the limits of the contract; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def is_utf8_text(value: str) -> bool:
    """Whether UTF-8 can encode ``value``: not when it holds a lone surrogate, which a JSON ``\\u``
    escape and a file name decoded with ``surrogateescape`` can carry, and no byte stream or store can."""
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def is_valid_name(value: object) -> bool:
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None


def is_valid_key(value: object) -> bool:
    return isinstance(value, str) and _KEY_RE.fullmatch(value) is not None and is_utf8_text(value)


def is_valid_event_id(value: object) -> bool:
    return isinstance(value, str) and _EVENT_ID_RE.fullmatch(value) is not None


def is_valid_host(value: object) -> bool:
    return isinstance(value, str) and _HOST_RE.fullmatch(value) is not None


def check_name(field: str, value: object) -> str:
    if not is_valid_name(value):
        raise LimitError(
            field,
            f"must be 1-{MAX_NAME_LENGTH} characters of A-Z a-z 0-9 . _ - starting with a letter or "
            f"digit, got {value!r}",
        )
    return value  # type: ignore[return-value]


def _check_int(field: str, value: object, low: int, high: int) -> int:
    # bool is an int subclass; True as a rank is a bug in the caller, not rank 1.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise LimitError(field, f"must be an integer, got {type(value).__name__} {value!r}")
    number = value.__index__()
    if not low <= number <= high:
        raise LimitError(field, f"must be between {low} and {high}, got {number}")
    return int(number)


def metric_value(key: str, value: Any) -> float:
    """One metric value as a float: Python, numpy or 0-d tensor scalars; NaN and Infinity kept."""
    if isinstance(value, float):
        return value
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise LimitError(f"metrics[{key!r}]", f"must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LimitError(
            f"metrics[{key!r}]", f"must be a number, got {type(value).__name__} ({exc})"
        ) from None
    if type(value).__name__ in ("bool_", "bool"):  # numpy.bool_ converts with float() too
        raise LimitError(f"metrics[{key!r}]", "must be a number, got a boolean")
    return number


#: Keys that already passed :func:`is_valid_key`: a training loop logs the same few keys every step,
#: so the hot path checks each key's characters once. Bounded so a caller inventing keys cannot grow it.
_CHECKED_KEYS: set[str] = set()
_CHECKED_KEYS_MAX = 65536


def _check_key(key: object) -> None:
    if not is_valid_key(key):
        raise LimitError(
            "metrics",
            f"key {key!r} must be 1-{MAX_KEY_LENGTH} printable characters of valid Unicode (no lone "
            "surrogates), without control characters or leading/trailing spaces",
        )
    if len(_CHECKED_KEYS) < _CHECKED_KEYS_MAX:
        _CHECKED_KEYS.add(key)  # type: ignore[arg-type]


def _check_weight(weight: object) -> float:
    if isinstance(weight, bool) or not hasattr(weight, "__float__"):
        raise LimitError("weight", f"must be a number, got {type(weight).__name__} {weight!r}")
    w = float(weight)
    if not (math.isfinite(w) and w >= 0):
        raise LimitError("weight", f"must be a finite number >= 0, got {w!r}")
    return w


def check_rank_event(
    metrics: Any,
    step: object,
    rank: object,
    world_size: object,
    local_rank: object = None,
    weight: object = 1.0,
) -> tuple[dict[str, float], int, int, int, int | None, float]:
    """Check one rank event against the limits and return it normalised.

    Raises :class:`LimitError` (a ``ValueError``) naming the argument that is out of bounds.
    The common case (plain ints, float values, keys seen before) takes a fast path of type checks
    and comparisons only; anything else goes through the full checks, with the same results.
    """
    # `type(x) is int` excludes bool (an int subclass: True as a rank is a bug, not rank 1).
    ws = (
        world_size
        if type(world_size) is int and 1 <= world_size <= MAX_WORLD_SIZE
        else _check_int("world_size", world_size, 1, MAX_WORLD_SIZE)
    )
    rk = rank if type(rank) is int and 0 <= rank < ws else _check_int("rank", rank, 0, ws - 1)
    st = step if type(step) is int and 0 <= step <= MAX_STEP else _check_int("step", step, 0, MAX_STEP)
    lr = (
        local_rank
        if local_rank is None or (type(local_rank) is int and 0 <= local_rank < ws)
        else _check_int("local_rank", local_rank, 0, ws - 1)
    )
    # `w - w == 0.0` is False for NaN and +/-Infinity.
    w = weight if type(weight) is float and weight - weight == 0.0 and weight >= 0 else _check_weight(weight)
    return check_metrics(metrics), st, rk, ws, lr, w


def check_metrics(metrics: Any) -> dict[str, float]:
    """An event's metrics checked (1-256 valid keys, numeric values) and as floats."""
    if not isinstance(metrics, dict):
        raise LimitError("metrics", f"must be a dict of metric name to number, got {type(metrics).__name__}")
    if not 1 <= len(metrics) <= MAX_KEYS_PER_EVENT:
        raise LimitError("metrics", f"must have 1-{MAX_KEYS_PER_EVENT} keys, got {len(metrics)}")
    values: dict[str, float] = {}
    checked = _CHECKED_KEYS
    for key, value in metrics.items():
        if key not in checked:
            _check_key(key)
        values[key] = value if type(value) is float else metric_value(key, value)
    return values


def check_scalars(metrics: Any, step: object) -> tuple[dict[str, float], int]:
    """Check one ``run.log`` event (its metrics and step) and return it normalised.

    The same rules, messages and fast path as :func:`check_rank_event`'s ``metrics`` and ``step``.
    """
    st = step if type(step) is int and 0 <= step <= MAX_STEP else _check_int("step", step, 0, MAX_STEP)
    return check_metrics(metrics), st


def wire_value(value: float) -> float | str:
    """A metric value as JSON carries it: finite numbers as numbers, the rest as contract strings."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
