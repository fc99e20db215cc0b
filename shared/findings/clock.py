"""Wall-clock findings (contract 7), which a summary of stored events alone cannot see. No I/O.

The watch learns a run's *pace* from the event times of its tail, round after round (``pace_of``):
its step interval (the median time between consecutive logged steps, each step timed by its first
event), its longest pause so far (evaluation, checkpointing: every rank silent at once), and each
rank's last event. Then, against the server's clock:

- ``stalled``: no rank has reported for longer than ``stall_after`` = the largest of ``STALL_MIN_S``,
  ``STALL_INTERVALS`` step intervals and ``STALL_PAUSE_FACTOR`` x the longest pause so far, and the
  run is not finished: ``warning``; beyond ``STALL_CRITICAL`` x that, ``critical``. The bar follows
  the run: a job that pauses 5 minutes for evaluation every hour is stalled only past 7.5 minutes once
  one such pause has been seen. (The first pause longer than ``STALL_MIN_S`` is one warning, resolved
  when the run goes on.)
- ``stopped_reporting`` by time: a rank behind the run's last step while its peers went on for longer
  than ``silent_after`` = the larger of ``SILENT_MIN_S`` and ``SILENT_INTERVALS`` step intervals (from
  when the first of them reached a later step, so a pause of every rank is not its silence):
  ``critical``. The summary's step rule (a rank 3 steps
  behind) is held to the same clock by ``settled_step``: while a run's events still arrive (finished
  or not: rank 0's "finished" may come before another rank's last events), its
  summary stops at the last step every rank heard from within ``silent_after`` has reached, so a
  rank whose uploads are only late is never "behind". In a hang nobody goes on: no rank is named
  stopped, the run is ``stalled``, and its message names the ranks behind the others.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from shared.findings.common import Finding, _finding
from shared.severity import Severity

STALL_MIN_S = 180.0
STALL_INTERVALS = 20.0
STALL_PAUSE_FACTOR = 1.5
STALL_CRITICAL = 2.0
SILENT_MIN_S = 30.0
SILENT_INTERVALS = 3.0
#: Step intervals needed before the median is trusted.
MIN_INTERVALS = 3
#: The newest steps whose times the pace keeps (when the first rank reached each).
KEPT_STEPS = 256


@dataclass
class Pace:
    """What the event times of a run's tail say, merged over rounds (kept in the run record)."""

    interval: float | None = None  # median seconds between consecutive logged steps
    longest_pause: float = 0.0  # the longest time between consecutive logged steps so far
    latest: float = 0.0  # the newest event time
    world_size: int = 0  # at the newest step
    ranks: list[int] = field(default_factory=list)  # each rank seen ...
    last_time: list[float] = field(default_factory=list)  # ... its last event time
    last_step: list[int] = field(default_factory=list)  # ... and its last step
    steps: list[int] = field(default_factory=list)  # the newest steps (at most ``KEPT_STEPS``) ...
    reached: list[float] = field(default_factory=list)  # ... and when the first rank reached each

    def quiet(self, last_step: int, last_time: float) -> float:
        """How long the others have gone on without a rank whose last step is ``last_step``: from when
        the first of them reached a later step to the newest event. An evaluation pause before that
        step is not silence: the others were silent too."""
        at = bisect.bisect_right(self.steps, last_step)
        if at == len(self.steps):
            return 0.0  # nobody has gone past it
        if at == 0:  # older than the steps kept: silent for at least this long
            return self.latest - last_time
        return self.latest - self.reached[at]


def pace_of(
    steps: NDArray[np.int64],
    ranks: NDArray[np.int64],
    times: NDArray[np.float64],
    world_sizes: NDArray[np.int64],
    before: Pace,
) -> Pace:
    """The pace of a run from events of its tail (one entry per event), merged with ``before``."""
    if len(steps) == 0:
        return before
    order = np.argsort(steps, kind="stable")
    sorted_steps, sorted_times = steps[order], times[order]
    unique, start = np.unique(sorted_steps, return_index=True)
    reached = np.minimum.reduceat(sorted_times, start)  # a step is reached by its first event
    gaps = np.maximum(np.diff(reached), 0.0)
    interval = float(np.median(gaps)) if len(gaps) >= MIN_INTERVALS else before.interval
    longest = max(before.longest_pause, float(gaps.max()) if len(gaps) else 0.0)
    size = max(int(ranks.max()), max(before.ranks, default=-1)) + 1
    last_time = np.full(size, -math.inf)
    last_step = np.full(size, -1, np.int64)
    np.maximum.at(last_time, ranks, times)
    np.maximum.at(last_step, ranks, steps)
    for rank, t, s in zip(before.ranks, before.last_time, before.last_step, strict=True):
        last_time[rank] = max(last_time[rank], t)
        last_step[rank] = max(last_step[rank], s)
    seen = np.nonzero(last_step >= 0)[0]
    known = dict(zip(before.steps, before.reached, strict=True))
    for step, t in zip(unique.tolist(), reached.tolist(), strict=True):
        known[step] = min(known.get(step, t), t)
    kept = sorted(known)[-KEPT_STEPS:]
    top = int(unique[-1])
    newest_world = int(world_sizes[steps == top].max())
    if before.last_step and max(before.last_step) > top:
        newest_world = before.world_size
    return Pace(
        interval=interval,
        longest_pause=longest,
        latest=max(before.latest, float(times.max())),
        world_size=newest_world,
        ranks=[int(r) for r in seen],
        last_time=[float(last_time[r]) for r in seen],
        last_step=[int(last_step[r]) for r in seen],
        steps=kept,
        reached=[known[step] for step in kept],
    )


def stall_after(pace: Pace) -> float:
    interval = pace.interval or 0.0
    return max(STALL_MIN_S, STALL_INTERVALS * interval, STALL_PAUSE_FACTOR * pace.longest_pause)


def silent_after(pace: Pace) -> float:
    return max(SILENT_MIN_S, SILENT_INTERVALS * (pace.interval or 0.0))


def duration(seconds: float) -> str:
    """``95`` -> ``"1 min 35 s"``: a wait in words a person reads at a glance."""
    if not math.isfinite(seconds):
        return "a long time"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{whole} s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {rest} s" if rest and minutes < 10 else "")
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def clock_findings(
    pace: Pace, run_last_step: int | None, finished: bool, received: float, now: float
) -> list[Finding]:
    """``stalled`` and time-based ``stopped_reporting`` rows for a run at ``now`` (server clock);
    ``received`` is when the server last received an event of the run."""
    findings: list[Finding] = []
    if run_last_step is None or not pace.ranks:
        return findings
    silent = max(0.0, now - received)
    bar = stall_after(pace)
    behind = [
        (rank, step)
        for rank, step in zip(pace.ranks, pace.last_step, strict=True)
        if step < run_last_step and rank < pace.world_size
    ]
    if not finished and silent > bar:
        severity: Severity = "critical" if silent > STALL_CRITICAL * bar else "warning"
        why = (
            f"the run logs a step every {duration(pace.interval)}"
            if pace.interval
            else "too few steps to know its pace"
        )
        if pace.longest_pause:
            why += f", and its longest pause so far was {duration(pace.longest_pause)}"
        hint = ""
        if 0 < len(behind) <= 4:
            listed = ", ".join(f"rank {rank} (step {step})" for rank, step in behind)
            hint = f"; behind the others: {listed}"
        findings.append(
            {
                **_finding(
                    "stalled",
                    None,
                    None,
                    run_last_step,
                    severity,
                    f"no rank has reported for {duration(silent)} ({why}); the run is at step "
                    f"{run_last_step} and not finished: a hung collective or a dead node?{hint}",
                ),
                "short": f"no rank for {duration(silent)}",
            }
        )
    limit = silent_after(pace)
    for rank, step, t in zip(pace.ranks, pace.last_step, pace.last_time, strict=True):
        if step >= run_last_step or rank >= pace.world_size:
            continue
        quiet = pace.quiet(step, t)
        if quiet > limit:
            findings.append(
                _finding(
                    "stopped_reporting",
                    rank,
                    None,
                    step,
                    "critical",
                    f"rank {rank} has not reported for {duration(quiet)} while the others went on to "
                    f"step {run_last_step} (its last step: {step}; the run logs a step every "
                    f"{duration(pace.interval or 0.0)})",
                )
            )
    return findings


def settled_step(pace: Pace, run_last_step: int | None, received: float, now: float) -> int | None:
    """The last step a summary of a run whose events are arriving should judge, None for all of it.

    Ranks' uploads arrive a few seconds apart, so the newest steps of a live run always miss some
    ranks that are only late (and rank 0's "finished" can arrive before another rank's last events).
    The watch judges the run up to the last step that every rank heard from within ``silent_after`` of
    the newest event has reached: a late rank is not "behind", while a rank silent for longer does not
    hold the window back (and is found behind). Once nothing has arrived for ``silent_after``, every
    step counts. -1: nothing is settled yet (a rank of a run younger than ``silent_after`` has not been
    heard from)."""
    if run_last_step is None or now - received > silent_after(pace):
        return None
    limit = silent_after(pace)
    unheard = len(set(range(pace.world_size)) - set(pace.ranks))
    young = bool(pace.steps) and len(pace.steps) < KEPT_STEPS and pace.latest - pace.reached[0] <= limit
    if unheard and young:
        return -1  # a young run whose first uploads are still arriving: nothing is settled yet
    live = [
        step
        for rank, step, t in zip(pace.ranks, pace.last_step, pace.last_time, strict=True)
        if rank < pace.world_size and pace.quiet(step, t) <= limit and step >= pace.steps[0] - 1
    ]
    if not live or min(live) >= run_last_step:
        return None
    return min(live)
