"""The store port's contract (issue 13, item 5; contract section 6), held by both adapters.

Every test here speaks only through the port (``put_events``, ``read_events``, ``next_step``, the
rollup half) and runs once per adapter through the ``store`` fixture: SQLite in a temporary directory
and DynamoDB in moto. Events are made the way the handlers make them (``validate_body`` then
``to_event``), so their payload digests are the real ones.
"""

from __future__ import annotations

import math
import random
import struct
import threading
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instantml import limits
from shared import rollups
from shared.errors import EventIdReused
from shared.events import RankEvent
from shared.ingest.bodies import validate_body
from shared.ingest.parse import to_event
from shared.store.dynamodb import DynamoStore
from shared.store.port import EventPage, MetricsStore, StoredEvent
from shared.store.sqlite import SqliteStore
from shared.summary.decoding import decode, units_from_run
from shared.summary.query import SummaryQuery
from shared.summary.reads import distributed_summary
from shared.summary.rolling import SETTLE_STEPS, roll_up, touched_steps
from tests.synthetic import synthetic_job

PROJECT = "proj"
RUN = "run-a"
NOW = 1_712_345_678.25  # the server's clock when a body has no time


def _event(
    step: int,
    rank: int = 0,
    *,
    run: str = RUN,
    project: str = PROJECT,
    event_id: str | None = None,
    world_size: int = 4,
    metrics: dict[str, Any] | None = None,
    time: float | None = None,
    weight: float = 1.0,
) -> RankEvent:
    """One rank event as the ingest handler makes it from a JSON body."""
    body: dict[str, Any] = {
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "weight": weight,
        "metrics": metrics if metrics is not None else {"train/loss": 1.0 + step / 1000 + rank / 10},
    }
    if time is not None:
        body["time"] = time
    return to_event(project, run, validate_body(body), event_id or f"{run}-s{step}-r{rank}", NOW)


def _packed(event: RankEvent) -> bytes:
    """What a stored event's ``packed`` must be: little-endian float64 [weight, time, *values]."""
    return struct.pack(f"<{2 + len(event.values)}d", event.weight, event.time, *event.values)


def _as_stored(event: RankEvent) -> tuple[str, int, int, int, tuple[str, ...], bytes]:
    return (event.event_id, event.step, event.rank, event.world_size, event.keys, _packed(event))


def _read_set(page: EventPage) -> Counter[tuple[str, int, int, int, tuple[str, ...], bytes]]:
    """A page's events as a multiset of plain tuples (the port promises no order inside a page)."""
    return Counter((e.event_id, e.step, e.rank, e.world_size, tuple(e.keys), e.packed) for e in page.events)


def _expect(events: list[RankEvent]) -> Counter[tuple[str, int, int, int, tuple[str, ...], bytes]]:
    return Counter(_as_stored(e) for e in events)


def _all(store: MetricsStore, run: str = RUN, project: str = PROJECT) -> EventPage:
    return store.read_events(project, run)


# put_events: one outcome per event, in order


def test_given_an_empty_run_when_an_event_is_put_then_it_is_stored_and_reads_back_as_sent(
    store: MetricsStore,
) -> None:
    event = _event(7, rank=2, metrics={"train/loss": 2.5, "optimizer/grad_norm": 0.75}, time=12.5)

    assert store.put_events([event]) == ["stored"]

    page = _all(store)
    assert page.complete_through is None
    assert _read_set(page) == _expect([event])
    [stored] = page.events
    assert (stored.event_id, stored.step, stored.rank, stored.world_size) == (f"{RUN}-s7-r2", 7, 2, 4)
    assert stored.keys == ["train/loss", "optimizer/grad_norm"]
    assert struct.unpack("<4d", stored.packed) == (1.0, 12.5, 2.5, 0.75)


def test_given_events_with_and_without_local_rank_then_each_reads_back_with_its_own(
    store: MetricsStore,
) -> None:
    """The node view needs each rank's place on its node (a node's first rank is rank - local_rank)."""
    placed = to_event(
        PROJECT,
        RUN,
        validate_body({"step": 3, "rank": 5, "world_size": 8, "local_rank": 1, "metrics": {"a": 1}}),
        "placed",
        NOW,
    )
    unplaced = _event(3, rank=6, world_size=8)

    assert store.put_events([placed, unplaced]) == ["stored", "stored"]

    assert {e.rank: e.local_rank for e in _all(store).events} == {5: 1, 6: None}


def test_given_an_empty_batch_when_it_is_put_then_there_are_no_outcomes_and_nothing_is_stored(
    store: MetricsStore,
) -> None:
    assert store.put_events([]) == []
    assert _all(store).events == []


def test_given_a_stored_event_when_the_same_payload_is_put_again_then_it_is_a_duplicate_and_nothing_changes(
    store: MetricsStore,
) -> None:
    first = _event(3, rank=1, metrics={"train/loss": 0.5})  # no time: the server's clock fills it in
    assert store.put_events([first]) == ["stored"]
    # The replay arrives later: the server's clock moved on, the body (and so the digest) did not.
    replay = to_event(
        PROJECT,
        RUN,
        validate_body({"step": 3, "rank": 1, "world_size": 4, "weight": 1.0, "metrics": {"train/loss": 0.5}}),
        first.event_id,
        NOW + 60,
    )
    assert replay.payload_digest == first.payload_digest
    assert replay.time != first.time

    assert store.put_events([replay]) == ["duplicate"]
    assert store.put_events([first, first]) == ["duplicate", "duplicate"]

    assert _read_set(_all(store)) == _expect([first])  # the first one's time, stored once


def test_given_a_stored_event_when_its_id_comes_back_with_another_payload_at_the_same_step_then_it_is_refused(
    store: MetricsStore,
) -> None:
    first = _event(3, rank=1, metrics={"train/loss": 0.5}, event_id="id-1")
    other = _event(3, rank=1, metrics={"train/loss": 0.75}, event_id="id-1")
    assert store.put_events([first]) == ["stored"]

    [outcome] = store.put_events([other])

    assert isinstance(outcome, EventIdReused)
    assert outcome.code == "idempotency_key_reused"
    assert "id-1" in str(outcome)
    assert _read_set(_all(store)) == _expect([first])  # the stored payload is untouched


def test_given_a_mixed_batch_when_it_is_put_then_the_outcomes_come_one_per_event_in_order(
    store: MetricsStore,
) -> None:
    stored_before = [_event(s, rank=0, event_id=f"old-{s}") for s in range(3)]
    assert store.put_events(stored_before) == ["stored"] * 3
    new = [_event(s, rank=1, event_id=f"new-{s}") for s in range(3)]
    reused = _event(1, rank=0, event_id="old-1", metrics={"train/loss": -1.0})
    batch = [new[0], stored_before[0], reused, new[1], stored_before[2], new[2]]

    outcomes = store.put_events(batch)

    assert len(outcomes) == len(batch)
    assert outcomes[:2] == ["stored", "duplicate"]
    assert isinstance(outcomes[2], EventIdReused)
    assert outcomes[3:] == ["stored", "duplicate", "stored"]
    assert _read_set(_all(store)) == _expect(stored_before + new)

    # The same batch again: every event is now known, the reused id is refused again.
    again = store.put_events(batch)
    assert [o if isinstance(o, str) else "reused" for o in again] == [
        "duplicate",
        "duplicate",
        "reused",
        "duplicate",
        "duplicate",
        "duplicate",
    ]
    assert _read_set(_all(store)) == _expect(stored_before + new)


# Idempotency under concurrent replays


def test_given_eight_clients_replaying_overlapping_batches_at_once_then_each_event_is_stored_exactly_once(
    store: MetricsStore,
) -> None:
    events = [_event(step, rank) for step in range(8) for rank in range(4)]  # 32 events
    threads_n = 8
    # Two batches that overlap in 8 events, each replayed by every thread at about the same moment:
    # in either order, some of them reversed, so the same event is put by several threads at once.
    first, second = events[:20], events[12:]
    plans = [
        [[first, second], [second, first], [first[::-1], second], [second[::-1], first[::-1]]][t % 4]
        for t in range(threads_n)
    ]
    barrier = threading.Barrier(threads_n)

    def client(plan: list[list[RankEvent]]) -> list[tuple[str, Any]]:
        barrier.wait(timeout=30)  # every client starts at once
        seen = []
        for batch in plan:
            outcomes = store.put_events(batch)
            assert len(outcomes) == len(batch)
            seen += [(e.event_id, o) for e, o in zip(batch, outcomes, strict=True)]
        return seen

    with ThreadPoolExecutor(max_workers=threads_n) as pool:
        results = list(pool.map(client, plans, timeout=120))  # a client's exception is raised here

    outcomes = [o for result in results for o in result]
    assert all(o in ("stored", "duplicate") for _, o in outcomes), outcomes
    stored = Counter(event_id for event_id, o in outcomes if o == "stored")
    assert stored == Counter({e.event_id: 1 for e in events})
    assert _read_set(_all(store)) == _expect(events)


# read_events: windows, isolation, late and out-of-order steps, max_items


def test_given_steps_0_to_9_when_windows_are_read_then_both_bounds_are_inclusive(store: MetricsStore) -> None:
    events = [_event(step, rank) for step in range(10) for rank in (0, 3)]
    store.put_events(events)

    def steps(step_min: int = 0, step_max: int | None = None) -> list[int]:
        page = store.read_events(PROJECT, RUN, step_min, step_max)
        assert page.complete_through is None
        return sorted(e.step for e in page.events)

    assert steps(3, 6) == [3, 3, 4, 4, 5, 5, 6, 6]
    assert steps(5, 5) == [5, 5]
    assert steps(0, 0) == [0, 0]
    assert steps(9) == [9, 9]
    assert steps(9, 9) == [9, 9]
    assert steps() == sorted(list(range(10)) * 2)
    assert steps(10) == []
    assert steps(10, 2**53 - 1) == []
    assert steps(6, 3) == []
    assert _read_set(store.read_events(PROJECT, RUN, 2, 4)) == _expect(
        [e for e in events if 2 <= e.step <= 4]
    )


def test_given_runs_written_interleaved_when_one_is_read_then_no_event_of_another_run_or_project_comes_back(
    store: MetricsStore,
) -> None:
    # Names that share prefixes, the same steps and ranks, and even the same event ids in every run.
    runs = [(PROJECT, "run"), (PROJECT, "run-1"), (PROJECT, "run-10"), ("proj-2", "run"), ("proj-2", "run-1")]
    written: dict[tuple[str, str], list[RankEvent]] = {key: [] for key in runs}
    for step in range(6):
        for n, (project, run) in enumerate(runs):
            event = _event(
                step,
                rank=step % 3,
                run=run,
                project=project,
                event_id=f"shared-{step}",
                metrics={"train/loss": float(100 * n + step)},
            )
            assert store.put_events([event]) == ["stored"]
            written[(project, run)].append(event)

    for (project, run), events in written.items():
        assert _read_set(store.read_events(project, run)) == _expect(events)
        assert _read_set(store.read_events(project, run, 2, 3)) == _expect(
            [e for e in events if 2 <= e.step <= 3]
        )
        assert store.next_step(project, run, 4) == 4
    assert store.read_events(PROJECT, "run-2").events == []
    assert store.read_events("proj-3", "run").events == []
    assert store.next_step(PROJECT, "run-2", 0) is None


def test_given_late_and_out_of_order_steps_written_shuffled_then_every_one_is_returned(
    store: MetricsStore,
) -> None:
    events = [_event(step, rank, world_size=3) for step in range(20) for rank in range(3)]
    shuffled = events[:]
    random.Random(13).shuffle(shuffled)
    on_time, late = shuffled[:-6], shuffled[-6:]
    for i in range(0, len(on_time), 9):  # batches of 9, in shuffled order
        assert store.put_events(on_time[i : i + 9]) == ["stored"] * len(on_time[i : i + 9])
    # The late ones arrive after later steps are stored (a lagging rank, a spool replayed later).
    for event in late:
        assert store.put_events([event]) == ["stored"]

    assert _read_set(_all(store)) == _expect(events)
    assert _read_set(store.read_events(PROJECT, RUN, 5, 14)) == _expect(
        [e for e in events if 5 <= e.step <= 14]
    )
    assert store.next_step(PROJECT, RUN, 0) == 0


def _check_page(page: EventPage, written: list[RankEvent], step_min: int, step_max: int | None) -> None:
    """A page cut by ``max_items``: whole steps only, and complete through ``complete_through``."""
    through = page.complete_through
    assert through is not None
    assert step_max is None or through < step_max
    assert _read_set(page) == _expect([e for e in written if step_min <= e.step <= through])


def test_given_more_events_than_max_items_when_read_then_the_page_stops_at_a_whole_step_and_says_where(
    store: MetricsStore,
) -> None:
    events = [_event(step, rank) for step in range(30) for rank in range(4)]  # 120 events, 4 per step
    store.put_events(events)

    page = store.read_events(PROJECT, RUN, max_items=32)
    _check_page(page, events, 0, None)
    assert len(page.events) <= 32
    assert page.complete_through is not None
    assert 0 <= page.complete_through < 29
    assert len(page.events) == 4 * (page.complete_through + 1)

    window = store.read_events(PROJECT, RUN, 10, 25, max_items=32)
    _check_page(window, events, 10, 25)
    assert window.complete_through is not None
    assert 10 <= window.complete_through < 25

    # Paging on from complete_through + 1 reads every event exactly once, then says it is complete.
    seen: Counter[Any] = Counter()
    step_min, pages = 0, 0
    while True:
        page = store.read_events(PROJECT, RUN, step_min, max_items=32)
        seen += _read_set(page)
        pages += 1
        if page.complete_through is None:
            break
        _check_page(page, events, step_min, None)
        assert page.complete_through >= step_min  # every page moves on
        step_min = page.complete_through + 1
    assert seen == _expect(events)
    assert pages <= 30


def test_given_a_window_read_before_when_events_land_in_it_then_the_next_read_has_them_all(
    store: MetricsStore,
) -> None:
    """A window read again (the tab refreshing a live run) sees every event stored since, late steps
    inside it too, and a replay changes nothing; a page cut by max_items is still cut at a whole step."""
    first = [_event(s, r) for s in range(5) for r in range(4)]
    store.put_events(first)
    assert _read_set(store.read_events(PROJECT, RUN, 0, 9)) == _expect(first)
    assert _read_set(store.read_events(PROJECT, RUN, 0, 9)) == _expect(first)  # read again: unchanged

    late = [_event(2, 3, event_id="late-2-3", metrics={"train/loss": 9.0}), _event(7, 0), _event(12, 0)]
    store.put_events(late)
    store.put_events(first[:3])  # a replay: duplicates
    assert _read_set(store.read_events(PROJECT, RUN, 0, 9)) == _expect(first + late[:2])
    page = store.read_events(PROJECT, RUN, 0, 9, max_items=20)  # 21 events up to step 4: cut before it
    through = page.complete_through
    assert through is not None
    assert through < 4
    assert _read_set(page) == _expect([e for e in first + late if e.step <= through])


def test_given_a_window_that_fits_in_max_items_when_read_then_it_is_complete(store: MetricsStore) -> None:
    events = [_event(step, rank) for step in range(5) for rank in range(4)]
    store.put_events(events)

    for page in (
        store.read_events(PROJECT, RUN),
        store.read_events(PROJECT, RUN, max_items=1000),
        store.read_events(PROJECT, RUN, 1, 3, max_items=1000),
    ):
        assert page.complete_through is None
    assert _read_set(store.read_events(PROJECT, RUN, max_items=1000)) == _expect(events)


# The tie rule (contract 6), through the summary


def test_given_two_events_at_the_same_step_rank_and_key_then_the_later_time_wins_ties_go_to_the_larger_id(
    store: MetricsStore,
) -> None:
    loss = "train/loss"

    def ev(step: int, rank: int, event_id: str, t: float, value: float) -> RankEvent:
        return _event(step, rank, event_id=event_id, world_size=2, time=t, metrics={loss: value})

    events = [
        # step 0, rank 0: the later time wins although its id is the smaller one; written first.
        ev(0, 0, "a-later", 20.0, 2.0),
        ev(0, 0, "z-earlier", 10.0, 1.0),
        # step 1, rank 0: the same time, so the larger id wins; the winner is written first.
        ev(1, 0, "tie-b", 30.0, 4.0),
        ev(1, 0, "tie-a", 30.0, 3.0),
        # rank 1 reports once per step.
        ev(0, 1, "r1-0", 10.0, 5.0),
        ev(1, 1, "r1-1", 30.0, 6.0),
    ]
    assert store.put_events(events) == ["stored"] * 6
    assert len(_all(store).events) == 6  # both events of a tie are stored: the rule is the reader's

    doc = distributed_summary(store, PROJECT, RUN, SummaryQuery())

    assert doc is not None
    assert doc["steps"] == [0, 1]
    assert doc["heatmap"][loss]["values"] == [[2.0, 4.0], [5.0, 6.0]]
    assert doc["reducers"][loss]["count"] == [2, 2]  # each rank counted once per step
    assert doc["reducers"][loss]["mean"] == [3.5, 5.0]
    assert doc["coverage"]["reported"] == [2, 2]
    assert [r["steps_reported"] for r in doc["rank_stats"]] == [2, 2]


# Floats: NaN, infinities and full float64 precision, bit for bit

SPECIAL_VALUES = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "0.1+0.2": 0.1 + 0.2,
    "1e-308": 1e-308,
    "2**53+1": float(2**53 + 1),
    "-0.0": -0.0,
    "5e-324": 5e-324,
    "max": 1.7976931348623157e308,
    "-min-normal": -2.2250738585072014e-308,
    "1/3": 1 / 3,
    "pi": math.pi,
}


def _json_value(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def test_given_nan_infinities_and_extreme_floats_when_stored_then_they_read_back_bit_for_bit(
    store: MetricsStore,
) -> None:
    metrics = {key: _json_value(v) for key, v in SPECIAL_VALUES.items()}
    event = _event(0, 0, world_size=1, metrics=metrics, time=1_712_345_678.123_456_7, weight=0.1 + 0.2)
    assert event.values[0] != event.values[0]  # the body's "NaN" became a float NaN

    assert store.put_events([event]) == ["stored"]

    [stored] = _all(store).events
    assert stored.keys == list(SPECIAL_VALUES)
    assert stored.packed == _packed(event)
    got = struct.unpack(f"<{len(stored.packed) // 8}d", stored.packed)
    want = [0.1 + 0.2, 1_712_345_678.123_456_7, *SPECIAL_VALUES.values()]
    assert [struct.pack("<d", g) for g in got] == [struct.pack("<d", w) for w in want]

    # ...and on to the summary: one rank, so each cell is the value itself, exactly.
    doc = distributed_summary(store, PROJECT, RUN, SummaryQuery())
    assert doc is not None
    for key, value in SPECIAL_VALUES.items():
        [[cell]] = doc["heatmap"][key]["values"]
        if math.isfinite(value):
            assert struct.pack("<d", cell) == struct.pack("<d", value), key  # -0.0 included
            assert doc["reducers"][key]["nonfinite"] == [0]
        else:
            assert cell is None, key
            assert doc["reducers"][key]["nonfinite"] == [1], key


# Steps near 2**53 - 1 and sparse steps: work follows the events, never the numeric range

SPARSE_STEPS = (0, 10**10, 2**53 - 2, 2**53 - 1)
MEMORY_LIMIT = 4 * 2**20  # bytes (measured: under 1.2 MB); a set or array over these steps takes terabytes


def _bounded(work: Any) -> tuple[Any, int, float]:
    """``work()``'s result, the peak of memory it allocated (bytes), and its time (s)."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        result = work()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak, time.monotonic() - started


def test_given_sparse_steps_up_to_2_53_minus_1_then_reads_summary_and_roll_up_follow_the_events_not_the_range(
    store: MetricsStore,
) -> None:
    events = [_event(step, rank, world_size=2) for step in SPARSE_STEPS for rank in range(2)]
    assert store.put_events(events) == ["stored"] * 8

    # Windows and next_step.
    assert _read_set(_all(store)) == _expect(events)
    assert sorted(e.step for e in store.read_events(PROJECT, RUN, 10**10, 10**10).events) == [10**10] * 2
    assert store.read_events(PROJECT, RUN, 1, 10**10 - 1).events == []
    assert sorted({e.step for e in store.read_events(PROJECT, RUN, 2**53 - 2).events}) == [
        2**53 - 2,
        2**53 - 1,
    ]
    assert [e.step for e in store.read_events(PROJECT, RUN, 2**53 - 1, 2**53 - 1).events] == [2**53 - 1] * 2
    assert store.next_step(PROJECT, RUN, 1) == 10**10
    assert store.next_step(PROJECT, RUN, 10**10 + 1) == 2**53 - 2
    assert store.next_step(PROJECT, RUN, 2**53 - 1) == 2**53 - 1
    assert store.next_step(PROJECT, RUN, 1, 2**53 - 3) == 10**10
    assert store.next_step(PROJECT, RUN, 10**10 + 1, 2**53 - 3) is None

    # The summary: one column per step that exists.
    doc, peak, seconds = _bounded(lambda: distributed_summary(store, PROJECT, RUN, SummaryQuery()))
    assert doc is not None
    assert doc["steps"] == list(SPARSE_STEPS)
    assert (doc["step_min"], doc["step_max"]) == (0, 2**53 - 1)
    assert doc["coverage"]["reported"] == [2, 2, 2, 2]
    assert peak < MEMORY_LIMIT
    assert seconds < 60

    # Rolling up: the steps that hold events, and the blocks above them at each level, not the 9 * 10**15
    # numbers between them; the newest steps wait for their ranks and stay raw.
    steps = touched_steps((PROJECT, RUN, e.step) for e in events)[(PROJECT, RUN)]
    assert steps == set(SPARSE_STEPS)
    rolled, peak, seconds = _bounded(lambda: roll_up(store, PROJECT, RUN, steps))
    n_levels = len(rollups.LEVELS)
    assert (rolled.blocks, rolled.events, rolled.through, rolled.left) == (
        2 * n_levels,
        4,
        2**53 - 1 - SETTLE_STEPS,
        0,
    )
    assert peak < MEMORY_LIMIT
    assert seconds < 60
    assert [h.block for h in store.read_blocks(PROJECT, RUN, 10, 0, 2**53)] == [0, 10**9]
    assert store.rollup_progress(PROJECT, RUN).step == 2**53 - 1 - SETTLE_STEPS

    # The summary from those rollups is as bounded, one column per step that exists.
    doc, peak, seconds = _bounded(lambda: distributed_summary(store, PROJECT, RUN, SummaryQuery()))
    assert doc is not None
    assert doc["resolution"]["unit"] == "step"
    assert (doc["resolution"]["rollup_blocks_read"], doc["resolution"]["events_read"]) == (2, 4)
    assert doc["steps"] == list(SPARSE_STEPS)
    assert peak < MEMORY_LIMIT
    assert seconds < 60

    # A late event at step 5 rolls that step and the blocks above it again, and only them.
    late = _event(5, 1, world_size=2)
    assert store.put_events([late]) == ["stored"]
    again, peak, _ = _bounded(lambda: roll_up(store, PROJECT, RUN, {5}))
    assert (again.blocks, again.events, again.through) == (n_levels, 1, 2**53 - 1 - SETTLE_STEPS)
    assert peak < MEMORY_LIMIT
    [block0] = store.read_blocks(PROJECT, RUN, 100, 0, 0)
    assert (block0.n_events, block0.first_step, block0.last_step) == (3, 0, 5)


# next_step


def test_given_stored_steps_when_next_step_is_asked_then_it_is_the_smallest_in_the_range(
    store: MetricsStore,
) -> None:
    assert store.next_step(PROJECT, RUN, 0) is None  # nothing stored yet
    # Ranks in different DynamoDB shards: the smallest step sits on rank 5 only.
    steps_of = {0: [3, 12], 5: [2, 7], 17: [7, 40]}
    store.put_events([_event(s, r, world_size=32) for r, steps in steps_of.items() for s in steps])

    assert store.next_step(PROJECT, RUN, 0) == 2
    assert store.next_step(PROJECT, RUN, 2) == 2
    assert store.next_step(PROJECT, RUN, 3) == 3
    assert store.next_step(PROJECT, RUN, 4) == 7
    assert store.next_step(PROJECT, RUN, 8, 11) is None
    assert store.next_step(PROJECT, RUN, 8, 12) == 12
    assert store.next_step(PROJECT, RUN, 12, 12) == 12
    assert store.next_step(PROJECT, RUN, 13) == 40
    assert store.next_step(PROJECT, RUN, 41) is None
    assert store.next_step(PROJECT, RUN, 0, 1) is None
    assert store.next_step(PROJECT, RUN, 0, 2) == 2
    assert store.next_step(PROJECT, RUN, 5, 4) is None
    assert store.next_step(PROJECT, "run-b", 0) is None
    assert store.next_step("proj-2", RUN, 0) is None


# Rollups: the more complete one is kept; progress never moves back


def _rolled(store: MetricsStore, block: int, size: int = 100) -> rollups.RolledBlock:
    """A block of ``size`` steps rolled up from its stored events, as the levels are."""
    events = store.read_events(PROJECT, RUN, block * size, block * size + size - 1).events
    run = decode(events)
    steps = np.unique(run.event_step)
    units = units_from_run(run, steps, np.arange(len(steps)), len(steps), int(run.event_world_size.max()))
    counts = np.bincount(np.searchsorted(steps, run.event_step))
    return rollups.combine(size, block, rollups.roll_steps(units, counts))


def _store_job(store: MetricsStore, events: list[StoredEvent], run: str = RUN) -> list[RankEvent]:
    rank_events = [_rank_event(e, run) for e in events]
    assert store.put_events(rank_events) == ["stored"] * len(rank_events)
    return rank_events


def _rank_event(e: StoredEvent, run: str = RUN, project: str = PROJECT) -> RankEvent:
    weight, t, *values = struct.unpack(f"<{len(e.packed) // 8}d", e.packed)
    body = {
        "step": e.step,
        "rank": e.rank,
        "world_size": e.world_size,
        "weight": weight,
        "time": t,
        "metrics": {k: _json_value(v) for k, v in zip(e.keys, values, strict=True)},
    }
    return to_event(project, run, validate_body(body), e.event_id, NOW)


def test_given_a_block_rolled_up_twice_when_both_are_written_then_the_one_that_read_more_events_is_kept(
    store: MetricsStore,
) -> None:
    job = synthetic_job(2, 100, keys=2)
    _store_job(store, [e for e in job if e.step < 40])
    partial = _rolled(store, 0)
    _store_job(store, [e for e in job if e.step >= 40])
    whole = _rolled(store, 0)
    assert (partial.header.n_events, whole.header.n_events) == (80, 200)
    keys = list(whole.sums)

    def kept() -> tuple[int, int, dict[str, bytes]]:
        [header] = store.read_blocks(PROJECT, RUN, 100, 0, 0)
        sums = store.read_block_sums(PROJECT, RUN, 100, keys, 0, 0)
        return header.n_events, header.last_step, {k: v[0] for k, v in sums.items()}

    # The smaller one first, then the larger: the larger replaces it (header and sums).
    store.write_blocks(PROJECT, RUN, [partial])
    assert kept() == (80, 39, partial.sums)
    store.write_blocks(PROJECT, RUN, [whole])
    assert kept() == (200, 99, whole.sums)
    # A stale roller writes the smaller one again: nothing moves back.
    store.write_blocks(PROJECT, RUN, [partial])
    assert kept() == (200, 99, whole.sums)
    [header] = store.read_blocks(PROJECT, RUN, 100, 0, 0)
    assert _same_header(header, whole.header)


def _same_header(a: rollups.BlockHeader, b: rollups.BlockHeader) -> bool:
    return a.packed() == b.packed() and (a.keys, a.block, a.size) == (b.keys, b.block, b.size)


def test_given_rolled_blocks_when_read_then_ranges_are_inclusive_in_block_order_and_per_run(
    store: MetricsStore,
) -> None:
    job = synthetic_job(2, 500, keys=1)
    _store_job(store, [e for e in job if e.step % 100 < 3])  # 3 steps in each of blocks 0-4
    rolled = [_rolled(store, b) for b in (4, 0, 2, 1, 3)]
    store.write_blocks(PROJECT, RUN, rolled)

    top = 2**53
    assert [h.block for h in store.read_blocks(PROJECT, RUN, 100, 0, top)] == [0, 1, 2, 3, 4]
    assert [h.block for h in store.read_blocks(PROJECT, RUN, 100, 1, 3)] == [1, 2, 3]
    assert [h.block for h in store.read_blocks(PROJECT, RUN, 100, 3, 3)] == [3]
    assert store.read_blocks(PROJECT, RUN, 100, 5, top) == []
    assert store.read_blocks(PROJECT, RUN, 10, 0, top) == []  # another level
    assert store.read_blocks(PROJECT, "run-b", 100, 0, top) == []
    assert store.read_blocks("proj-2", RUN, 100, 0, top) == []
    sums = store.read_block_sums(PROJECT, RUN, 100, ["train/loss", "no/such-key"], 1, 2)
    by_block = {r.header.block: r for r in rolled}
    assert sums == {
        "train/loss": {1: by_block[1].sums["train/loss"], 2: by_block[2].sums["train/loss"]},
        "no/such-key": {},
    }
    assert store.read_block_sums(PROJECT, "run-b", 100, ["train/loss"], 0, 4) == {"train/loss": {}}
    assert store.read_block_sums(PROJECT, RUN, 1000, ["train/loss"], 0, 4) == {"train/loss": {}}


def test_given_rollup_progress_when_it_is_advanced_then_the_step_never_moves_back(
    store: MetricsStore,
) -> None:
    assert store.rollup_progress(PROJECT, RUN) == (-1, b"")
    nodes = np.array([0, 0, 2, 2], "<i4").tobytes()
    store.advance_rollups(PROJECT, RUN, 3, nodes)
    assert store.rollup_progress(PROJECT, RUN) == (3, nodes)
    store.advance_rollups(PROJECT, RUN, 1, b"")
    assert store.rollup_progress(PROJECT, RUN).step == 3
    store.advance_rollups(PROJECT, RUN, 2**53 - 1, nodes)
    assert store.rollup_progress(PROJECT, RUN) == (2**53 - 1, nodes)
    store.advance_rollups(PROJECT, RUN, 0, nodes)
    assert store.rollup_progress(PROJECT, RUN).step == 2**53 - 1

    assert store.rollup_progress(PROJECT, "run-b").step == -1
    assert store.rollup_progress("proj-2", RUN).step == -1


# One job, two adapters, identical summaries


@pytest.fixture
def both(metrics_table: str, atomic_moto_puts: None, tmp_path: Path) -> tuple[MetricsStore, MetricsStore]:
    """A SQLite store and a DynamoDB (moto) store side by side, not through the parametrized fixture."""
    return SqliteStore(tmp_path / "side-by-side.db"), DynamoStore(metrics_table)


QUERIES = [
    SummaryQuery(),
    SummaryQuery(step_min=5, step_max=20),
    SummaryQuery(max_steps=4),
    SummaryQuery(keys=("train/loss",), outlier_method="z", outlier_threshold=1.5),
]


@pytest.mark.slow
def test_given_one_job_in_sqlite_and_in_dynamodb_then_their_summaries_are_identical(
    both: tuple[MetricsStore, MetricsStore],
) -> None:
    lite, dynamo = both
    job = synthetic_job(8, 25, ("nan", "stop", "gaps", "slow", "spikes", "disagree"), seed=3)
    for s in (lite, dynamo):
        _store_job(s, job)
    # A tie at (step 7, rank 3): a second event, later, with other values.
    weight, _, *values = struct.unpack("<5d", next(e for e in job if (e.step, e.rank) == (7, 3)).packed)
    tie = StoredEvent(
        "z-tie", 7, 3, 8, list(job[0].keys), struct.pack("<5d", weight, 99.0, *[v * 2 for v in values])
    )
    for s in (lite, dynamo):
        _store_job(s, [tie])

    for query in QUERIES:
        assert distributed_summary(lite, PROJECT, RUN, query) == distributed_summary(
            dynamo, PROJECT, RUN, query
        )

    # The same from rollups, after both rolled the same steps up, a late one included.
    late = _rank_event(StoredEvent("late-250", 250, 0, 8, list(job[0].keys), job[0].packed))
    for s in (lite, dynamo):
        assert s.put_events([late]) == ["stored"]
        assert roll_up(s, PROJECT, RUN, set(range(25)) | {250}).through == 250 - SETTLE_STEPS
    for name, (lite_h, dynamo_h) in {
        size: (
            lite.read_blocks(PROJECT, RUN, size, 0, 10**6),
            dynamo.read_blocks(PROJECT, RUN, size, 0, 10**6),
        )
        for size in rollups.LEVELS
    }.items():
        assert [h.packed() for h in lite_h] == [h.packed() for h in dynamo_h], name
    for query in (SummaryQuery(), SummaryQuery(max_steps=2)):
        lite_doc = distributed_summary(lite, PROJECT, RUN, query)
        assert lite_doc is not None
        assert lite_doc["resolution"]["rollup_blocks_read"] > 0
        assert lite_doc == distributed_summary(dynamo, PROJECT, RUN, query)


_runs = count()
_keys = st.sampled_from(["train/loss", "optimizer/grad_norm"])
_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.1 + 0.2, 5e-324, -0.0, 1e-308, float(2**53 + 1)]),
)


@st.composite
def _jobs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A small job as JSON bodies: few ranks and steps (sparse ones too), ties at a (step, rank, key),
    replays of a whole body, non-finite and extreme values."""
    world_size = draw(st.integers(1, 4))
    steps = draw(
        st.lists(st.sampled_from([0, 1, 2, 99, 100, 10**10, 2**53 - 1]), min_size=1, max_size=3, unique=True)
    )
    bodies: list[dict[str, Any]] = []
    for step in steps:
        for rank in range(world_size):
            for tie in range(draw(st.integers(0 if bodies else 1, 2))):
                metrics = draw(st.dictionaries(_keys, _values, min_size=1, max_size=2))
                bodies.append(
                    {
                        "event_id": f"e-{step}-{rank}-{tie}",
                        "step": step,
                        "rank": rank,
                        "world_size": world_size,
                        "weight": draw(st.sampled_from([1.0, 0.5, 3.0])),
                        "time": draw(st.sampled_from([1.0, 2.0])),  # few times: ties go to the larger id
                        "metrics": {k: _json_value(v) for k, v in metrics.items()},
                    }
                )
    replays = draw(st.lists(st.sampled_from(bodies), max_size=3))
    return draw(st.permutations(bodies + replays))


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=_jobs(), query=st.sampled_from(QUERIES[:3]))
def test_given_any_small_job_stored_in_both_adapters_then_outcomes_and_summaries_are_identical(
    both: tuple[MetricsStore, MetricsStore], bodies: list[dict[str, Any]], query: SummaryQuery
) -> None:
    run = f"prop-{next(_runs)}"  # the stores outlive the examples: each example has its own run
    events = [
        to_event(
            PROJECT, run, validate_body({k: v for k, v in b.items() if k != "event_id"}), b["event_id"], NOW
        )
        for b in bodies
    ]
    lite, dynamo = both
    lite_outcomes, dynamo_outcomes = lite.put_events(events), dynamo.put_events(events)
    # A body replayed inside one batch races itself on DynamoDB's concurrent puts: which copy is the
    # "stored" one may differ, how many are is the same.
    assert Counter(lite_outcomes) == Counter(dynamo_outcomes)
    assert set(lite_outcomes) <= {"stored", "duplicate"}
    assert Counter(lite_outcomes)["stored"] == len({b["event_id"] for b in bodies})
    assert _read_set(lite.read_events(PROJECT, run)) == _read_set(dynamo.read_events(PROJECT, run))

    lite_doc = distributed_summary(lite, PROJECT, run, query)
    assert lite_doc == distributed_summary(dynamo, PROJECT, run, query)
    if query == SummaryQuery():
        assert lite_doc is not None
    if lite_doc is not None:
        assert np.all(np.diff(lite_doc["steps"]) > 0)
        assert all(0 <= s <= limits.MAX_STEP for s in lite_doc["steps"])
