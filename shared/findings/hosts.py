"""Where to look next: the host of a finding's rank. No I/O.

Each process of a job says once, at ``im.init``, which host it runs on (``socket.gethostname()``, sent as
``PATCH .../runs/{run_id}`` ``{"hosts": {"3": "gpu-node-07"}}``; only a process whose launcher set its
rank knows it). The run's record keeps them (``RunRecord.hosts``); a finding that names a rank whose
host is known gets ``host`` and says it: ``...; rank 3 runs on host gpu-node-07``. A ``node_outlier``
names its node by its first rank, whose host is the node's. A finding without a rank, or of a rank that
never said, is left as it is (``host`` absent: unknown).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.findings.common import Finding


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
