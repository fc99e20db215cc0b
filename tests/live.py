"""Synthetic jobs (``tests/jobs.py``) replayed as live streams: their events arrive in a real SQLite
store in the order and at the times they would (each rank's uploads a little late), and the watch
(``shared.watch.rounds.watch_round``) runs its rounds on the same simulated clock. What a webhook would have
been sent, and when, is the outcome.

    outcome = replay(healthy_job("realistic", 8, 200, 0), tmp_path / "db", pause_every=50, pause_s=60)
    outcome.alerts("warning")      # [] for a healthy job

Evaluation pauses (``pause_every`` steps, ``pause_s`` seconds: every rank silent at once, as trainers
do) and a hang (``hang_after``: every rank silent from that step on, the run never finished) are
added to the job's own timing. Pure standard library and numpy over the project's own code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.events import RankEvent
from shared.ingest import activity
from shared.severity import Severity
from shared.store.sqlite import SqliteStore
from shared.watch.rounds import Transition, reaches, watch_round
from tests.jobs import Job

PROJECT, RUN = "p", "r"
#: The replay's epoch: a plausible wall clock.
T0 = 1_800_000_000.0


@dataclass
class Clock:
    now: float = T0

    def __call__(self) -> float:
        return self.now


@dataclass
class Outcome:
    transitions: list[tuple[float, Transition]] = field(default_factory=list)
    last_event: float = T0  # when the job's last event was received
    rounds: int = 0
    failed: list[str] = field(default_factory=list)

    def alerts(self, min_severity: Severity = "warning") -> list[tuple[float, Transition]]:
        """The ``opened`` alerts a webhook with ``min_severity`` would have received."""
        return [(t, x) for t, x in self.transitions if x.state == "opened" and reaches(x, min_severity)]

    def first(self, kind: str, rank: int | None = None, min_severity: Severity = "warning") -> float | None:
        """When an alert of ``kind`` (on ``rank``) first reached a webhook with ``min_severity``."""
        for t, x in self.alerts(min_severity):
            if x.finding["kind"] == kind and (rank is None or x.finding["rank"] == rank):
                return t
        return None


def live_events(
    job: Job,
    pause_every: int,
    pause_s: float,
    hang_after: int | None,
    lag_s: float,
    seed: int,
    slower: float = 1.0,
) -> list[tuple[float, RankEvent]]:
    """The job's events as (time received, event), in the order received: each rank's a little late
    (up to ``lag_s``), in the order it logged them. ``slower`` stretches the job's own timing (a job of
    0.3 s steps at ``slower=3`` takes about a second a step)."""
    rng = np.random.default_rng(seed)
    out = []
    sent: dict[int, float] = {}  # each rank's uploads arrive in the order it logged them
    for e in sorted(job.events, key=lambda e: (e.rank, e.step)):
        if hang_after is not None and e.step > hang_after:
            continue
        packed = np.frombuffer(e.packed, "<f8")
        pauses = e.step // pause_every if pause_every else 0
        time = T0 + float(packed[1]) * slower + pauses * pause_s
        event = RankEvent(
            PROJECT,
            RUN,
            e.event_id,
            e.step,
            e.rank,
            e.world_size,
            e.local_rank,
            float(packed[0]),
            time,
            tuple(e.keys),
            tuple(float(v) for v in packed[2:]),
            hashlib.sha256(e.packed).digest()[:16],
        )
        received = max(sent.get(e.rank, 0.0), time + float(rng.uniform(0.0, lag_s)))
        sent[e.rank] = received
        out.append((received, event))
    out.sort(key=lambda pair: pair[0])
    return out


def replay(
    job: Job,
    path: Path,
    *,
    round_s: float = 10.0,
    pause_every: int = 0,
    pause_s: float = 0.0,
    hang_after: int | None = None,
    lag_s: float = 1.5,
    tail_s: float = 420.0,
    seed: int = 0,
    slower: float = 1.0,
) -> Outcome:
    """Replay ``job`` into a new store at ``path``, watching every ``round_s`` simulated seconds, and
    ``tail_s`` past its last event (the run finished then, unless it hangs)."""
    clock = Clock()
    store = SqliteStore(path, clock=clock)
    events = live_events(job, pause_every, pause_s, hang_after, lag_s, seed, slower)
    outcome = Outcome()
    if not events:
        return outcome
    clock.now = events[0][0]
    next_round = clock.now + round_s
    i = 0
    finish_at = events[-1][0] + 1.0
    end = events[-1][0] + tail_s
    finished = False
    while clock.now <= end:
        clock.now += 1.0
        batch = []
        while i < len(events) and events[i][0] <= clock.now:
            batch.append(events[i][1])
            i += 1
        if batch:
            store.put_events(batch)
            store.note_activity(PROJECT, RUN, activity.activity(batch, clock.now))
        if hang_after is None and not finished and clock.now >= finish_at:
            store.update_run(PROJECT, RUN, clock.now, finished=True)
            finished = True
        if clock.now >= next_round:
            next_round += round_s
            report = watch_round(store, now=clock.now)
            outcome.rounds += 1
            outcome.failed += report.failed
            outcome.transitions += [(clock.now, t) for _, _, t in report.transitions]
    outcome.last_event = events[-1][1].time
    store.db.close()
    return outcome
