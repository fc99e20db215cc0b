"""Coverage: which ranks reported which steps. No I/O.

Read from the steps each rank reported, single steps one by one and rolled-up blocks as counts
(:class:`RolledCoverage`), before any key's values. Both rules count steps, not time: a rank is behind
once the others are steps ahead of it.

- ``stopped_reporting`` (critical): a rank below the world size has not reported the run's last
  ``STOP_GRACE_STEPS + 1`` steps or more (fewer: ``info``, it may only be catching up).
- ``missing_steps``: a rank is absent at steps between its first and last that others reported;
  ``warning`` when it missed ``MIN_MISSING`` steps or more and the other ranks' rate (their misses per
  rank, plus one) makes that many less likely than ``MISSING_P`` (Poisson), else ``info`` (a lost event
  now and then is every rank's lot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from shared.findings.common import Finding, _finding, _list_steps, _poisson_tail

STOP_GRACE_STEPS = 2
MIN_MISSING = 2
MISSING_P = 1e-4


@dataclass(frozen=True)
class RolledCoverage:
    """Per rank, what rolled-up blocks (counts per block, no single steps) add to coverage."""

    behind: NDArray[np.int64]  # steps after the rank's last one where it was expected
    missed: NDArray[np.int64]  # steps between its first and last that it missed
    span: NDArray[np.int64]  # steps between its first and last
    first_gap_step: NDArray[np.int64]  # first step of the first block with a miss, -1 for none


def coverage_findings(
    present: NDArray[np.bool_],
    step_world_size: NDArray[np.int64],
    steps: NDArray[np.int64],
    last_seen: NDArray[np.int64],
    first_seen: NDArray[np.int64],
    run_last: int | None,
    rolled: RolledCoverage | None = None,
) -> list[Finding]:
    """``stopped_reporting`` and ``missing_steps`` from who reported at each single step known.

    ``present`` (ranks x ``steps``) covers the steps read one by one; ``first_seen``/``last_seen`` are
    each rank's first and last step in the whole window (-1: never), including rolled-up blocks, whose
    counts come in ``rolled``.
    """
    findings: list[Finding] = []
    if run_last is None:
        return findings
    ranks = np.arange(len(last_seen))
    expected = ranks[:, None] < step_world_size[None, :]  # rank r is expected at step s
    absent: list[tuple[int, int, int, NDArray[np.intp]]] = []
    zero = np.zeros(len(ranks), np.int64)
    rolled_behind = zero if rolled is None else rolled.behind
    rolled_missed = zero if rolled is None else rolled.missed
    rolled_span = zero if rolled is None else rolled.span
    rolled_gap = zero - 1 if rolled is None else rolled.first_gap_step
    for r in ranks:
        last = int(last_seen[r])
        if last < 0:
            behind = int(expected[r].sum() + rolled_behind[r])
            if behind:
                findings.append(
                    _finding(
                        "stopped_reporting",
                        int(r),
                        None,
                        None,
                        "critical" if behind > STOP_GRACE_STEPS else "info",
                        f"rank {r} never reported in this window, though the world size included it "
                        f"at {behind} step{'s' if behind != 1 else ''}; the run is at step {run_last}",
                    )
                )
            continue
        behind = int((expected[r] & (steps > last)).sum() + rolled_behind[r])
        if behind:
            critical = behind > STOP_GRACE_STEPS
            findings.append(
                _finding(
                    "stopped_reporting",
                    int(r),
                    None,
                    last,
                    "critical" if critical else "info",
                    f"rank {r} has not reported since step {last}; the run is at step "
                    f"{run_last} ({behind} step{'s' if behind != 1 else ''} behind"
                    + (")" if critical else ", it may only be catching up)"),
                )
            )
        inside = (steps >= first_seen[r]) & (steps <= last)
        gaps = np.nonzero(expected[r] & inside & ~present[r])[0]
        missed = len(gaps) + int(rolled_missed[r])
        if missed:
            span = int((inside & (step_world_size > 0)).sum() + rolled_span[r])
            absent.append((int(r), missed, span, gaps))
    total = sum(a[1] for a in absent)
    for rank, missed, span, gaps in absent:
        # A rank's gaps against the other ranks' rate (one lost event now and then is every rank's lot).
        rate = (total - missed + 1) / max(len(ranks) - 1, 1)
        warn = missed >= MIN_MISSING and _poisson_tail(missed, rate) < MISSING_P
        listed = [int(s) for s in steps[gaps]]
        where = [f"steps {_list_steps(listed)}"] if listed else []
        if rolled_missed[rank]:
            where.append(f"{int(rolled_missed[rank])} in rolled-up blocks from step {int(rolled_gap[rank])}")
        where_text = "; ".join(where)
        first_gap = min(listed[:1] + ([int(rolled_gap[rank])] if rolled_missed[rank] else []))
        findings.append(
            _finding(
                "missing_steps",
                rank,
                None,
                first_gap,
                "warning" if warn else "info",
                f"rank {rank} is intermittently absent: it missed {missed} of the {span} steps "
                f"between steps {int(first_seen[rank])} and {int(last_seen[rank])} that the others reported "
                f"({where_text})" + ("" if warn else "; the other ranks miss steps about as often"),
            )
        )
    return findings
