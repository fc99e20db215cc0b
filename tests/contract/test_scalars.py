"""The scalar half of the store port (``ScalarStore``, issue 15): ``run.log`` events stored once per id
like rank events, read by step window, and never mixed with rank events. Every test runs once per
adapter through the ``store`` fixture (SQLite and DynamoDB in moto)."""

from __future__ import annotations

import hashlib
import json
import struct

from shared.errors import EventIdReused
from shared.events import RankEvent, ScalarEvent
from shared.ingest.bodies import validate_body
from shared.ingest.parse import to_event
from shared.store.dynamodb import event_of_key, scalar_partition, sort_key
from shared.store.port import EventPage, MetricsStore

PROJECT = "proj"
RUN = "run-a"


def _scalar(
    step: int,
    rank: int = 0,
    *,
    run: str = RUN,
    project: str = PROJECT,
    event_id: str | None = None,
    metrics: dict[str, float] | None = None,
    time: float | None = None,
) -> ScalarEvent:
    """One scalar event as the contract describes it: a rank's values at a step, a digest of the body."""
    metrics = metrics if metrics is not None else {"train/loss": 1.0 + step / 100, "lr": 0.001}
    time = 1_700_000_000.0 + step if time is None else time
    body = {"step": step, "rank": rank, "metrics": metrics, "time": time}
    return ScalarEvent(
        project=project,
        run_id=run,
        event_id=event_id or f"{run}-scalar-s{step}-r{rank}",
        step=step,
        rank=rank,
        time=time,
        keys=tuple(metrics),
        values=tuple(metrics.values()),
        payload_digest=hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).digest(),
    )


def _rank_event(step: int, rank: int = 0, run: str = RUN) -> RankEvent:
    body = {"step": step, "rank": rank, "world_size": 2, "metrics": {"train/loss": 2.0}, "time": 1.0 + step}
    return to_event(PROJECT, run, validate_body(body), f"{run}-event-s{step}-r{rank}", 1.0)


def _ids(page: EventPage) -> list[str]:
    return sorted(e.event_id for e in page.events)


def test_given_scalars_when_put_then_they_read_back_as_sent_with_world_size_0(store: MetricsStore) -> None:
    event = _scalar(7, rank=1, metrics={"train/loss": 0.25, "lr": float("nan")}, time=12.5)

    assert store.put_scalars([event]) == ["stored"]

    page = store.read_scalars(PROJECT, RUN)
    assert page.complete_through is None
    [stored] = page.events
    assert (stored.event_id, stored.step, stored.rank, stored.world_size, stored.local_rank) == (
        event.event_id,
        7,
        1,
        0,
        None,
    )
    assert stored.keys == ["train/loss", "lr"]
    assert stored.packed == struct.pack("<4d", 1.0, 12.5, 0.25, float("nan"))


def test_given_an_empty_batch_when_scalars_are_put_then_there_are_no_outcomes(store: MetricsStore) -> None:
    assert store.put_scalars([]) == []
    assert store.read_scalars(PROJECT, RUN).events == []


def test_given_stored_scalars_when_put_again_then_duplicates_and_a_reused_id_is_refused(
    store: MetricsStore,
) -> None:
    first, second = _scalar(1), _scalar(2)
    assert store.put_scalars([first, second]) == ["stored", "stored"]

    assert store.put_scalars([second, first]) == ["duplicate", "duplicate"]
    reused = _scalar(1, event_id=first.event_id, metrics={"train/loss": 9.0})
    new = _scalar(3)
    outcomes = store.put_scalars([reused, new, first])
    assert isinstance(outcomes[0], EventIdReused)
    assert outcomes[1:] == ["stored", "duplicate"]

    page = store.read_scalars(PROJECT, RUN)
    assert _ids(page) == sorted([first.event_id, second.event_id, new.event_id])
    [kept] = [e for e in page.events if e.event_id == first.event_id]
    assert struct.unpack("<4d", kept.packed)[2] == 1.01  # the first payload stays


def test_given_scalars_and_rank_events_of_one_run_then_each_read_returns_only_its_own(
    store: MetricsStore,
) -> None:
    scalars = [_scalar(step) for step in range(5)]
    events = [_rank_event(step, rank) for step in range(5) for rank in range(2)]
    # The same ids on both sides: they are different stores, so neither is a duplicate of the other.
    same_id = _scalar(1, event_id=events[0].event_id)
    assert store.put_scalars([*scalars, same_id]) == ["stored"] * 6
    assert store.put_events(events) == ["stored"] * 10

    assert _ids(store.read_scalars(PROJECT, RUN)) == sorted(e.event_id for e in [*scalars, same_id])
    assert _ids(store.read_events(PROJECT, RUN)) == sorted(e.event_id for e in events)
    assert all(e.world_size == 0 for e in store.read_scalars(PROJECT, RUN).events)
    assert all(e.world_size == 2 for e in store.read_events(PROJECT, RUN).events)


def test_given_only_scalars_then_the_run_has_no_rank_events_and_no_next_step(store: MetricsStore) -> None:
    assert store.put_scalars([_scalar(step) for step in (3, 4)]) == ["stored", "stored"]

    assert store.read_events(PROJECT, RUN).events == []
    assert store.next_step(PROJECT, RUN, 0) is None


def test_given_scalars_of_several_runs_and_projects_then_a_read_returns_only_its_runs(
    store: MetricsStore,
) -> None:
    mine = [_scalar(step) for step in range(3)]
    other_run = [_scalar(step, run="run-b") for step in range(3)]
    other_project = [_scalar(step, project="other") for step in range(3)]
    store.put_scalars([*other_run, *mine, *other_project])

    assert _ids(store.read_scalars(PROJECT, RUN)) == sorted(e.event_id for e in mine)
    assert _ids(store.read_scalars(PROJECT, "run-b")) == sorted(e.event_id for e in other_run)
    assert len(store.read_scalars("other", RUN).events) == 3
    assert store.read_scalars(PROJECT, "unknown").events == []


def test_given_steps_0_to_9_when_scalar_windows_are_read_then_both_bounds_are_inclusive(
    store: MetricsStore,
) -> None:
    store.put_scalars([_scalar(step) for step in reversed(range(10))])

    def steps(page: EventPage) -> list[int]:
        return sorted(e.step for e in page.events)

    assert steps(store.read_scalars(PROJECT, RUN, 3, 6)) == [3, 4, 5, 6]
    assert steps(store.read_scalars(PROJECT, RUN, 7)) == [7, 8, 9]
    assert steps(store.read_scalars(PROJECT, RUN, 0, 0)) == [0]
    assert steps(store.read_scalars(PROJECT, RUN, 10)) == []
    assert steps(store.read_scalars(PROJECT, RUN, 2**53 - 1)) == []


def test_given_more_scalars_than_max_items_when_read_then_the_page_stops_at_a_whole_step(
    store: MetricsStore,
) -> None:
    store.put_scalars([_scalar(step, rank) for step in range(10) for rank in range(3)])

    page = store.read_scalars(PROJECT, RUN, max_items=10)
    # Items 0..10 in step order are steps 0,0,0,1,1,1,2,2,2,3,3: step 3 may be cut, 0-2 are whole.
    assert page.complete_through == 2
    assert sorted((e.step, e.rank) for e in page.events) == [(s, r) for s in range(3) for r in range(3)]

    rest = store.read_scalars(PROJECT, RUN, 3, max_items=10)
    assert rest.complete_through == 5
    assert len(rest.events) == 9

    assert store.read_scalars(PROJECT, RUN, max_items=30).complete_through is None
    assert len(store.read_scalars(PROJECT, RUN, max_items=30).events) == 30
    assert store.read_scalars(PROJECT, RUN, 8, max_items=6).complete_through is None


def test_scalar_items_are_no_events_of_the_rollup_stream() -> None:
    """The DynamoDB layout: scalars live in an ``@`` partition, which the rollup stream skips."""
    assert scalar_partition(PROJECT, RUN) == f"@scalars#{PROJECT}#{RUN}"
    assert event_of_key(scalar_partition(PROJECT, RUN), sort_key(5, "e1")) is None
    assert event_of_key(f"{PROJECT}#{RUN}#00", sort_key(5, "e1")) == (PROJECT, RUN, 5)
