"""The severities of a finding (contract 5.5) and their order, defined once: the findings carry them,
the summary and the watch sort by them, a webhook's ``min_severity`` is one, and the runs index counts
by them. A leaf of the standard library alone: the ingest and alerts functions, which never load numpy,
count and validate with it too (``shared.findings``, which holds the rules, needs numpy)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

Severity = Literal["info", "warning", "critical"]
#: Least to most severe.
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
_RANK = {name: i for i, name in enumerate(SEVERITIES)}


def severity_rank(severity: Severity) -> int:
    """0 for ``info`` up to 2 for ``critical``: ``max(rows, key=...)`` picks the most severe."""
    return _RANK[severity]


def severity_counts(severities: Iterable[Severity]) -> dict[Severity, int]:
    """How many of each, the most severe first (the runs index's ``findings``: contract 3.3)."""
    counts = dict.fromkeys(reversed(SEVERITIES), 0)
    for severity in severities:
        counts[severity] += 1
    return counts
