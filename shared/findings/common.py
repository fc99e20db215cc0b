"""What the families of findings share: the row (``Finding``) and its wording, the most severe first,
and what more than one family measures (a time key by its name, a large fold, a Poisson tail). No I/O.
The severities and their order are ``shared.severity``'s."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TypedDict

from shared.severity import Severity, severity_rank


class _Row(TypedDict):
    kind: str
    rank: int | None
    key: str | None
    step: int | None
    severity: Severity
    message: str


# The keys a row may lack are those of a subclass with total=False (NotRequired is Python 3.11's, and
# the server also runs on 3.10 from the client's wheel).
class Finding(_Row, total=False):
    """One row of findings (contract 5.5): ``rank``, ``key`` and ``step`` are null where it names none."""

    #: The host of ``rank``, where the run's record knows it (added by ``hosts.name_hosts``).
    host: str
    #: A ``stalled`` row in a few words, for the runs page's headline (``clock.clock_findings``).
    short: str
    #: The kind of the rows a ``node_outlier`` row replaces (``nodes``).
    of: str
    #: A ``memory_growth`` row's forecast: the step at which the rank reaches its limit (``system``).
    forecast_step: int


#: A value this many times (or 1/this) its usual ratio to its peers is large: on a positive key a
#: ``spike`` must be at least this far out, and a ``persistent_outlier`` this far apart is a ``warning``
#: however few its columns.
SPIKE_FOLD = 2.0

TIME_KEY = re.compile(r"time|latency|duration|wait|(^|[/_.])(ms|sec|secs|seconds)$", re.IGNORECASE)


def is_time_key(key: str) -> bool:
    """Whether a key's name says it measures time (``system/data_time``, ``step_ms``, ``latency``)."""
    return bool(TIME_KEY.search(key))


def worst_first(findings: Iterable[Finding]) -> list[Finding]:
    """The most severe first, rows of one severity in the order given (the summary's and the watch's)."""
    return sorted(findings, key=lambda f: -severity_rank(f["severity"]))


def _finding(
    kind: str, rank: int | None, key: str | None, step: int | None, severity: Severity, message: str
) -> Finding:
    return {"kind": kind, "rank": rank, "key": key, "step": step, "severity": severity, "message": message}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _share(held: int, total: int, pers: str) -> str:
    """``held`` of ``total`` steps (or columns) as a person says it: "at all 200 of its steps", "at 180
    of its 200 steps", "in 160 of its 167 columns (3 steps each)". ``pers`` is ``"steps"`` or
    ``"columns (N steps each)"`` (:func:`_pers`)."""
    unit, _, each = pers.partition(" ")
    where = "at" if unit == "steps" else "in"
    text = f"{where} all {total} of its {unit}" if held == total else f"{where} {held} of its {total} {unit}"
    return text + (f" {each}" if each else "")


def _pers(bin_size: int) -> str:
    """What a column is, for :func:`_share` and the messages: ``steps``, or ``columns (N steps each)``."""
    return "steps" if bin_size == 1 else f"columns ({bin_size} steps each)"


def _list_steps(steps: list[int], limit: int = 5) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def _poisson_tail(n: int, lam: float) -> float:
    """P(N >= n) for N ~ Poisson(lam)."""
    term = math.exp(-lam)
    below = 0.0
    for k in range(n):
        below += term
        term *= lam / (k + 1)
    return max(0.0, 1.0 - below)
