"""Across keys and ranks: the rules that read every key's findings and replace some rows with one.
No I/O.

- ``straggler`` (warning): a rank with a ``warning`` ``persistent_outlier`` *above* its peers on one
  time key (its name matches ``TIME_KEY``: data loading, its own compute) and *below* them on another
  beyond chance (rules 1-3, any size: a time that includes waiting at the collectives is shorter for
  the rank the others wait for): one row replaces theirs, and says about how much time a step the job
  loses to it.
- ``node_outlier``: when at least half of a node's ranks (2 or more; ``local_rank`` gives the layout)
  share a finding of the same kind and key, one row names the node (``rank`` is its first rank) and
  replaces theirs; severity is the most severe of them.

Where to look next, the host of a finding's rank (:func:`name_hosts`): each process of a job says once,
at ``im.init``, which host it runs on (``socket.gethostname()``, sent as ``PATCH .../runs/{run_id}``
``{"hosts": {"3": "gpu-node-07"}}``; only a process whose launcher set its rank knows it). The run's
record keeps them (``RunRecord.hosts``); a finding that names a rank whose host is known gets ``host``
and says it: ``...; rank 3 runs on host gpu-node-07``. A ``node_outlier`` names its node by its first
rank, whose host is the node's. A finding without a rank, or of a rank that never said, is left as it
is (``host`` absent: unknown).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from shared.findings.common import Finding, _finding, is_time_key
from shared.findings.keys import KeyResult
from shared.severity import severity_rank

#: Kinds a node's ranks can share (one row per node instead of one per rank).
NODE_KINDS = (
    "stopped_reporting",
    "missing_steps",
    "persistent_outlier",
    "noisy_rank",
    "spike",
    "straggler",
    "memory_growth",
    "memory_high",
    "gpu_idle",
)


def cross_key_findings(
    findings: list[Finding], results: dict[str, KeyResult], node_start: NDArray[np.int64] | None = None
) -> list[Finding]:
    """The rules that look across keys and ranks: ``straggler`` and ``node_outlier``."""
    findings = _stragglers(findings, results)
    if node_start is not None and len(node_start):
        findings = _nodes(findings, node_start)
    return findings


def _stragglers(findings: list[Finding], results: dict[str, KeyResult]) -> list[Finding]:
    """A rank persistently high on one time key and low on another is the straggler the others wait
    for: its own work (data loading, compute) takes longer, and a time that includes waiting at the
    collectives is shorter for it, because it is the one the others wait for. One finding replaces
    its two ``persistent_outlier`` rows."""
    times = {k: r for k, r in results.items() if r.relative and is_time_key(k)}
    ranks = {rank for r in times.values() for rank, o in r.offsets.items() if o.direction > 0}
    replaced: set[tuple[int, str]] = set()
    added: list[Finding] = []
    for rank in sorted(ranks):
        high = [
            (k, o)
            for k, r in times.items()
            if (o := r.offsets.get(rank)) is not None and o.direction > 0 and o.severity == "warning"
        ]
        low = [(k, r.below[rank]) for k, r in times.items() if rank in r.below]
        if not high or not low:
            continue
        (hk, ho), (lk, lo) = max(high, key=lambda x: x[1].held), max(low, key=lambda x: x[1].held)
        replaced |= {(rank, hk), (rank, lk)}
        added.append(
            _finding(
                "straggler",
                rank,
                hk,
                None,
                "warning",
                f"rank {rank} is the straggler the other ranks wait for: its {hk} is {ho.size} the median "
                f"rank on {ho.held} of {ho.columns} steps, while its {lk}, which includes waiting for the "
                f"others, is {lo.size}; the job loses about {abs(ho.excess):.2g} of {hk} a step to it",
            )
        )
    kept = [
        f for f in findings if not (f["kind"] == "persistent_outlier" and (f["rank"], f["key"]) in replaced)
    ]
    return kept + added


def _nodes(findings: list[Finding], node_start: NDArray[np.int64]) -> list[Finding]:
    """``node_outlier``: when at least half of a node's ranks (2 or more; ``local_rank`` gives the
    layout: a node's first rank is ``rank - local_rank``) share a finding (kind and key), one row names
    the node and its ranks instead of one row per rank."""
    size: dict[int, list[int]] = {}
    for rank, start in enumerate(node_start.tolist()):
        if start >= 0:
            size.setdefault(start, []).append(rank)
    groups: dict[tuple[str, str | None, int], list[Finding]] = {}
    for f in findings:
        r = f["rank"]
        if f["kind"] in NODE_KINDS and r is not None and r < len(node_start) and node_start[r] >= 0:
            groups.setdefault((f["kind"], f["key"], int(node_start[r])), []).append(f)
    merged: set[int] = set()
    added: list[Finding] = []
    for (kind, key, start), rows in groups.items():
        members = size[start]
        if len(members) < 2 or len(rows) < 2 or 2 * len(rows) < len(members):
            continue
        merged |= {id(f) for f in rows}
        severity = max((f["severity"] for f in rows), key=severity_rank)
        span = (
            f"{members[0]}-{members[-1]}"
            if members == list(range(members[0], members[-1] + 1))
            else (", ".join(map(str, members)))
        )
        added.append(
            {
                **_finding(
                    "node_outlier",
                    start,
                    key,
                    min((f["step"] for f in rows if f["step"] is not None), default=None),
                    severity,
                    f"the node of ranks {span}: {len(rows)} of its {len(members)} ranks share one finding "
                    f"({kind.replace('_', ' ')}{' on ' + key if key else ''}), so the cause is likely the "
                    f"node (host, network, storage); for example: {rows[0]['message']}",
                ),
                "of": kind,
            }
        )
    return [f for f in findings if id(f) not in merged] + added


def name_hosts(findings: list[Finding], hosts: Mapping[int, str] | None) -> list[Finding]:
    """``findings`` with the host of each one's rank, when known (a named row is a new dict; the others
    are the same objects)."""
    if not hosts:
        return findings
    out = []
    for finding in findings:
        rank = finding.get("rank")
        host = hosts.get(rank) if isinstance(rank, int) and "host" not in finding else None
        if host is not None:
            finding = {
                **finding,
                "host": host,
                "message": f"{finding['message']}; rank {rank} runs on host {host}",
            }
        out.append(finding)
    return out
