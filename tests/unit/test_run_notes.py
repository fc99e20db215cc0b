"""A process skips notes that cannot change a run's record (one DynamoDB item per run: 512 ranks' batches
would otherwise write it a thousand times a second), and the record still ends up the same."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from shared.ingest.activity import ACTIVITY_RESOLUTION_S, ActivityNotes
from shared.store.port import RunActivity
from shared.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from shared.findings import Finding


class CountingStore(SqliteStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.notes = 0

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        self.notes += 1
        super().note_activity(project, run_id, activity)


def batches(seed: int, n: int = 600) -> list[RunActivity]:
    """A 64-rank job's batches: mostly the newest step, a rank at a time or a node at a time, some late
    ones of earlier steps, and scalars; times a few milliseconds apart, a little out of order."""
    rng = random.Random(seed)
    out, step, t = [], 0, 1_000.0
    for _ in range(n):
        t += rng.uniform(0, 0.02)
        kind = rng.random()
        if kind < 0.05:
            out.append(RunActivity(t))  # run.log scalars: time only
            continue
        if kind < 0.15:
            step += 1
        at = step - (rng.randrange(1, 4) if kind > 0.9 and step > 3 else 0)
        first = rng.randrange(0, 64, 8)
        ranks = frozenset(range(first, first + rng.choice((1, 8))))
        out.append(RunActivity(t - rng.uniform(0, 0.05), at, ranks, 64))
    return out


def record(store: SqliteStore) -> Any:
    return store.get_run("p", "r")


@pytest.mark.slow
def test_skipped_notes_leave_the_same_record_with_far_fewer_writes(tmp_path: Path) -> None:
    for seed in range(5):
        every, skipping = (
            CountingStore(tmp_path / f"every{seed}.db"),
            CountingStore(tmp_path / f"skip{seed}.db"),
        )
        notes = ActivityNotes()
        for activity in batches(seed):
            every.note_activity("p", "r", activity)
            notes.note(skipping, "p", "r", activity)
        want, got = record(every), record(skipping)
        assert (got.last_step, got.world_size, got.ranks_reporting) == (
            want.last_step,
            want.world_size,
            want.ranks_reporting,
        )
        assert want.last_event - ACTIVITY_RESOLUTION_S <= got.last_event <= want.last_event
        assert got.created == want.created
        # Each batch here brings one rank or one node of the newest step: new ranks half of the time.
        assert skipping.notes < every.notes * 0.7, (seed, skipping.notes, every.notes)


def test_a_new_step_new_ranks_and_a_later_second_are_always_written(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "x.db")
    notes = ActivityNotes()
    notes.note(store, "p", "r", RunActivity(10.0, 5, frozenset({0}), 8))
    notes.note(store, "p", "r", RunActivity(10.1, 5, frozenset({0}), 8))  # nothing new
    notes.note(store, "p", "r", RunActivity(10.2, 4, frozenset({3}), 8))  # an older step
    assert store.notes == 1
    notes.note(store, "p", "r", RunActivity(10.3, 5, frozenset({1}), 8))  # a new rank at the last step
    notes.note(store, "p", "r", RunActivity(10.4, 6, frozenset({1}), 8))  # a new step
    notes.note(store, "p", "r", RunActivity(12.0))  # a later second
    notes.note(store, "p", "r", RunActivity(9.0))  # older: nothing
    assert store.notes == 4
    got = store.get_run("p", "r")
    assert got is not None
    assert (got.last_step, got.ranks_reporting, got.last_event) == (6, 1, 12.0)
    notes.note(store, "p", "other", RunActivity(12.0, 6, frozenset({1}), 8))  # another run is its own
    assert store.notes == 5


class TimeCountingStore(CountingStore):
    """Counts the notes whose time is newer than every time noted before: on DynamoDB, the writes of
    the run's own item (the one both runs indexes hold)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.times: list[float] = []

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        if not self.times or activity.time > self.times[-1]:
            self.times.append(activity.time)
        super().note_activity(project, run_id, activity)


@pytest.mark.slow
def test_held_times_write_the_run_s_time_about_once_a_second_losing_at_most_a_second(tmp_path: Path) -> None:
    for seed in range(5):
        every, held = CountingStore(tmp_path / f"every{seed}.db"), TimeCountingStore(tmp_path / f"h{seed}.db")
        notes = ActivityNotes(hold_time_s=ACTIVITY_RESOLUTION_S)
        activities = batches(seed, 2000)  # about 20 s of a 64-rank job's batches
        for activity in activities:
            every.note_activity("p", "r", activity)
            notes.note(held, "p", "r", activity)
        want, got = record(every), record(held)
        assert (got.last_step, got.world_size, got.ranks_reporting, got.created) == (
            want.last_step,
            want.world_size,
            want.ranks_reporting,
            want.created,
        )
        assert want.last_event - ACTIVITY_RESOLUTION_S <= got.last_event <= want.last_event
        seconds = activities[-1].time - activities[0].time
        assert len(held.times) <= seconds / ACTIVITY_RESOLUTION_S + 2, (len(held.times), seconds)
        assert all(b - a > ACTIVITY_RESOLUTION_S for a, b in zip(held.times, held.times[1:], strict=False))


class RefusingStore(SqliteStore):
    """Refuses the notes whose number is in ``refuse`` (throttled), as DynamoDB may."""

    def __init__(self, path: Path, refuse: set[int]) -> None:
        super().__init__(path)
        self.refuse, self.n = refuse, 0

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        self.n += 1
        if self.n in self.refuse:
            from shared.errors import StoreThrottled

            raise StoreThrottled("the runs table is throttling writes")
        super().note_activity(project, run_id, activity)


@pytest.mark.slow
def test_a_refused_note_waits_for_the_run_s_next_note_and_the_record_ends_the_same(tmp_path: Path) -> None:
    for seed in range(5):
        rng = random.Random(seed)
        activities = batches(seed)
        every = CountingStore(tmp_path / f"every{seed}.db")
        refusing = RefusingStore(tmp_path / f"refusing{seed}.db", set(rng.sample(range(1, 400), 80)))
        notes = ActivityNotes()
        answers = []
        for activity in activities:
            every.note_activity("p", "r", activity)
            answers.append(notes.note(refusing, "p", "r", activity))
        notes.note(refusing, "p", "r", RunActivity(0.0))  # a last note: nothing of its own
        assert answers.count(False) > 0
        want, got = record(every), record(refusing)
        assert (got.last_step, got.world_size, got.ranks_reporting) == (
            want.last_step,
            want.world_size,
            want.ranks_reporting,
        )
        assert want.last_event - ACTIVITY_RESOLUTION_S <= got.last_event <= want.last_event


@pytest.mark.slow
def test_merged_activities_note_what_both_would(tmp_path: Path) -> None:
    from shared.ingest.activity import merge

    rng = random.Random(3)
    for n in range(200):
        both = [
            RunActivity(
                rng.randrange(8) / 2,
                rng.choice([None, *range(4)]),
                frozenset(rng.sample(range(8), rng.randrange(3))),
                rng.choice([None, 4, 8]),
            )
            for _ in range(2)
        ]
        apart, merged = SqliteStore(tmp_path / f"a{n}.db"), SqliteStore(tmp_path / f"m{n}.db")
        start = RunActivity(0.0, 1, frozenset({0}), 4)
        for store in (apart, merged):
            store.note_activity("p", "r", start)
        for activity in both:
            apart.note_activity("p", "r", activity)
        merged.note_activity("p", "r", merge(*both))
        assert dataclasses.replace(record(apart), received=None) == dataclasses.replace(
            record(merged), received=None
        ), both


class FindingsCountingStore(SqliteStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes = 0

    def note_findings(self, project: str, run_id: str, findings: str, at: float) -> None:
        self.writes += 1
        super().note_findings(project, run_id, findings, at)


def test_unchanged_findings_counts_are_rewritten_at_most_once_a_minute(tmp_path: Path) -> None:
    from shared.runs import FINDINGS_REWRITE_S, note_findings

    store = FindingsCountingStore(tmp_path / "f.db")
    store.note_activity("p", "r", RunActivity(1.0, 0, frozenset({0}), 1))
    warning: list[Finding] = [
        {"kind": "spike", "rank": 0, "key": "k", "step": 0, "severity": "warning", "message": "rank 0 spikes"}
    ]
    note_findings(store, "p", "r", warning, 100.0)
    note_findings(store, "p", "r", warning, 105.0)  # the tab's next poll: the same counts
    assert store.writes == 1
    note_findings(store, "p", "r", [], 110.0)  # changed: written at once
    assert store.writes == 2
    note_findings(store, "p", "r", [], 110.0 + FINDINGS_REWRITE_S)  # unchanged, but a minute on
    assert store.writes == 3
    record = store.get_run("p", "r")
    assert record is not None
    assert record.findings == '{"critical":0,"warning":0,"info":0}'


def test_a_process_remembers_the_runs_noted_most_recently_and_forgets_the_oldest(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from shared.ingest import activity

    monkeypatch.setattr(activity, "NOTED_RUNS", 2)
    store, notes = CountingStore(tmp_path / "notes.db"), ActivityNotes()
    same = RunActivity(1_000.0, 5, frozenset({0}), 1)
    for run_id in ("a", "b", "c"):
        notes.note(store, "p", run_id, same)
    assert store.notes == 3
    notes.note(store, "p", "b", same)
    notes.note(store, "p", "c", same)
    assert store.notes == 3  # b and c are remembered: nothing new, nothing written
    notes.note(store, "p", "a", same)
    assert store.notes == 4  # a, noted longest ago, was forgotten: written again
