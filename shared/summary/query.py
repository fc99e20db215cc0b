"""The query of a Distributed summary (``GET .../distributed?keys=...&step_min=...``): its parameters,
their limits and defaults, parsed once at the edge."""

from __future__ import annotations

import re
from dataclasses import dataclass

from instantml import limits
from shared import stats
from shared.errors import FieldError, InvalidInput

DEFAULT_MAX_STEPS = 200
MAX_MAX_STEPS = 5000
DEFAULT_OUTLIER_LIMIT = 100
MAX_OUTLIER_LIMIT = 10000
#: ``outlier_method``: how ``score`` is computed for each value against the other ranks at its column.
#: ``modified_z`` (default): 0.6745 * (x - median) / MAD, MeanAD fallback when MAD is 0 (stats.robust_scores).
#: ``z``: the plain z-score (x - mean) / std, which cannot exceed sqrt(n - 1) among n ranks.
OUTLIER_METHODS = ("modified_z", "z")
#: ``heatmap``: how the heatmap travels (``shared.summary.wire``). ``auto`` (default) is ``lists`` up to
#: ``wire.AUTO_LIST_CELLS`` cells, else ``base64``; ``none`` leaves the heatmap and the outliers out.
HEATMAP_ENCODINGS = ("auto", "lists", "base64", "none")
#: ``since``: a document's ``version`` (``shared.summary.wire``); at most this long (a few hundred bytes
# today).
MAX_SINCE_LENGTH = 2048


@dataclass(frozen=True)
class SummaryQuery:
    """The summary's query parameters (contract 5), already parsed."""

    keys: tuple[str, ...] | None = None
    step_min: int | None = None
    step_max: int | None = None
    max_steps: int = DEFAULT_MAX_STEPS
    outlier_method: str = "modified_z"
    outlier_threshold: float = stats.DEFAULT_OUTLIER_THRESHOLD
    outlier_limit: int = DEFAULT_OUTLIER_LIMIT
    heatmap: str = "auto"
    since: str | None = None


class Params:
    """A query string read against the names a route knows: every problem is collected, and
    :meth:`check` raises them together (``InvalidInput`` naming each field)."""

    def __init__(self, params: dict[str, str], known: set[str]) -> None:
        self.params = params
        self.errors = [
            FieldError(_shown(name), "is not a known parameter") for name in params if name not in known
        ]
        # A lone surrogate (which no URL can carry, but an event can) is refused before any value is
        # used: "keys" are compared with stored keys, and no store or log can encode one.
        self.errors += [
            FieldError(_shown(name), "must be valid Unicode text (no lone surrogates)")
            for name, value in params.items()
            if name in known and not limits.is_utf8_text(value)
        ]

    def integer(self, name: str, low: int, high: int) -> int | None:
        raw = self.params.get(name)
        if raw is None or raw == "":
            return None
        # ASCII digits only ("²".isdigit() is true, and int() refuses it), and no more of them than the
        # bound has: int() of thousands of digits is slow, then refused.
        if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(high)) or not low <= int(raw) <= high:
            self.errors.append(FieldError(name, f"must be an integer from {low} to {high}, got {raw!r}"))
            return None
        return int(raw)

    def window(self) -> tuple[int | None, int | None]:
        """``step_min`` and ``step_max``, the first not above the second."""
        step_min = self.integer("step_min", 0, limits.MAX_STEP)
        step_max = self.integer("step_max", 0, limits.MAX_STEP)
        if step_min is not None and step_max is not None and step_min > step_max:
            self.errors.append(FieldError("step_min", "must not be greater than step_max"))
        return step_min, step_max

    def keys(self) -> tuple[str, ...] | None:
        raw = self.params.get("keys")
        return tuple(k for k in raw.split(",") if k) if raw else None

    def check(self) -> None:
        if self.errors:
            first = self.errors[0]
            raise InvalidInput(f"{first.field} {first.message}", self.errors)


def _shown(name: str) -> str:
    """A parameter's name as an error can carry it: lone surrogates as ``\\u`` escapes."""
    return name if limits.is_utf8_text(name) else name.encode("utf-8", "backslashreplace").decode()


_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")

#: The parameters of a window of steps (the summary's and the scalars' routes).
WINDOW_PARAMETERS = {"keys", "step_min", "step_max", "max_steps"}


def parse_query(params: dict[str, str]) -> SummaryQuery:
    """Query string parameters to a :class:`SummaryQuery`; a bad one raises ``InvalidInput``."""
    known = WINDOW_PARAMETERS | {"outlier_method", "outlier_threshold", "outlier_limit", "heatmap", "since"}
    query = Params(params, known)
    errors = query.errors
    step_min, step_max = query.window()
    max_steps = query.integer("max_steps", 1, MAX_MAX_STEPS)
    outlier_limit = query.integer("outlier_limit", 0, MAX_OUTLIER_LIMIT)
    method = params.get("outlier_method") or "modified_z"
    if method not in OUTLIER_METHODS:
        choices = ", ".join(OUTLIER_METHODS)
        errors.append(FieldError("outlier_method", f"must be one of {choices}, got {method!r}"))
    heatmap = params.get("heatmap") or "auto"
    if heatmap not in HEATMAP_ENCODINGS:
        choices = ", ".join(HEATMAP_ENCODINGS)
        errors.append(FieldError("heatmap", f"must be one of {choices}, got {heatmap!r}"))
    since = params.get("since") or None
    if since is not None and (len(since) > MAX_SINCE_LENGTH or not _BASE64URL.fullmatch(since)):
        errors.append(FieldError("since", "must be the version of an earlier answer to this query"))
    threshold = stats.DEFAULT_OUTLIER_THRESHOLD
    if params.get("outlier_threshold"):
        try:
            threshold = float(params["outlier_threshold"])
            if not 0 < threshold < 1e6:
                raise ValueError
        except ValueError:
            errors.append(FieldError("outlier_threshold", "must be a positive number below 1e6"))
    query.check()
    return SummaryQuery(
        keys=query.keys(),
        step_min=step_min,
        step_max=step_max,
        max_steps=max_steps or DEFAULT_MAX_STEPS,
        outlier_method=method,
        outlier_threshold=threshold,
        outlier_limit=DEFAULT_OUTLIER_LIMIT if outlier_limit is None else outlier_limit,
        heatmap=heatmap,
        since=since,
    )
