"""What the families of findings share: the row and its wording, the severity order, and what more
than one family measures (a time key by its name, a large fold, a Poisson tail). No I/O."""

from __future__ import annotations

import math
import re
from typing import Any

Finding = dict[str, Any]

#: Severity order (contract 5.5), least to most severe.
SEVERITIES = ("info", "warning", "critical")
_RANK = {name: i for i, name in enumerate(SEVERITIES)}

#: A value this many times (or 1/this) its usual ratio to its peers is large: on a positive key a
#: ``spike`` must be at least this far out, and a ``persistent_outlier`` this far apart is a ``warning``
#: however few its columns.
SPIKE_FOLD = 2.0

TIME_KEY = re.compile(r"time|latency|duration|wait|(^|[/_.])(ms|sec|secs|seconds)$", re.IGNORECASE)


def is_time_key(key: str) -> bool:
    """Whether a key's name says it measures time (``system/data_time``, ``step_ms``, ``latency``)."""
    return bool(TIME_KEY.search(key))


def severity_rank(severity: str) -> int:
    """0 for ``info`` up to 2 for ``critical``: ``max(rows, key=...)`` picks the most severe."""
    return _RANK[severity]


def _finding(
    kind: str, rank: int | None, key: str | None, step: int | None, severity: str, message: str
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
