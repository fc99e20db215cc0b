"""The run records of the store port (``RunStore``, issue 15): folded from accepted events, updated by
the client (config, finished) and the summary (findings), listed newest first with a cursor and a
status filter. Every test but the last runs once per adapter through the ``store`` fixture (SQLite,
and DynamoDB in moto with the template's runs table and its ``by_activity`` index)."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.store.dynamodb import DynamoStore
from shared.store.port import MetricsStore, RunActivity, RunRecord, RunStatus
from shared.store.sqlite import SqliteStore

PROJECT = "proj"
RUN = "run-a"
T0 = 1_700_000_000.25


def _note(
    store: MetricsStore,
    time: float,
    step: int | None = None,
    ranks: set[int] | None = None,
    world_size: int | None = None,
    run: str = RUN,
    project: str = PROJECT,
) -> None:
    store.note_activity(project, run, RunActivity(time, step, frozenset(ranks or ()), world_size))


def _run(store: MetricsStore, run: str = RUN) -> RunRecord:
    """The run's record without ``received`` (the server's clock, which the watch's tests check)."""
    record = store.get_run(PROJECT, run)
    assert record is not None
    return _without(record, "received")


def _without(record: RunRecord, *fields: str) -> RunRecord:
    return dataclasses.replace(record, **dict.fromkeys(fields))  # type: ignore[arg-type]


# get_run and note_activity


def test_given_no_record_then_get_run_is_none(store: MetricsStore) -> None:
    assert store.get_run(PROJECT, RUN) is None
    _note(store, T0, run="other")
    assert store.get_run(PROJECT, RUN) is None
    assert store.get_run("other-project", "other") is None


def test_given_scalars_only_activity_then_the_run_exists_with_no_step_world_or_ranks(
    store: MetricsStore,
) -> None:
    _note(store, T0)

    assert _run(store) == RunRecord(run_id=RUN, created=T0, last_event=T0)


def test_given_activities_then_created_is_set_once_and_last_event_only_grows(store: MetricsStore) -> None:
    _note(store, T0 + 10)
    _note(store, T0 + 5)  # an older batch arriving late
    assert (_run(store).created, _run(store).last_event) == (T0 + 10, T0 + 10)

    _note(store, T0 + 20)
    assert (_run(store).created, _run(store).last_event) == (T0 + 10, T0 + 20)
    _note(store, T0 + 20)
    _note(store, T0)
    assert (_run(store).created, _run(store).last_event) == (T0 + 10, T0 + 20)


def test_given_rank_activity_then_last_step_grows_ranks_join_at_a_step_and_reset_at_a_newer_one(
    store: MetricsStore,
) -> None:
    _note(store, T0, step=5, ranks={0, 1}, world_size=4)
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (5, 2, 4)

    _note(store, T0 + 1, step=5, ranks={1, 2, 3}, world_size=4)  # same step: a union
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (5, 4, 4)

    _note(store, T0 + 2, step=6, ranks={3}, world_size=8)  # newer step: its ranks and world only
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (6, 1, 8)

    before = _run(store)
    _note(store, T0 + 3, step=4, ranks={0, 1, 2}, world_size=2)  # older step: only activity counts
    assert _run(store) == dataclasses.replace(before, last_event=T0 + 3)

    _note(store, T0 + 4)  # scalars only: the step part stays
    assert _run(store) == dataclasses.replace(before, last_event=T0 + 4)


def test_given_one_step_with_several_world_sizes_then_the_largest_is_kept(store: MetricsStore) -> None:
    _note(store, T0, step=3, ranks={0}, world_size=8)
    _note(store, T0, step=3, ranks={1}, world_size=4)
    _note(store, T0, step=3, ranks={1}, world_size=None)
    assert (_run(store).world_size, _run(store).ranks_reporting) == (8, 2)

    _note(store, T0, step=3, ranks={1}, world_size=16)
    assert (_run(store).world_size, _run(store).ranks_reporting) == (16, 2)


def test_given_a_step_with_no_ranks_then_ranks_reporting_is_0_until_some_come(store: MetricsStore) -> None:
    _note(store, T0, step=2, ranks={0, 1}, world_size=2)
    _note(store, T0, step=3, ranks=set(), world_size=None)
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (3, 0, None)

    _note(store, T0, step=3, ranks={1}, world_size=2)
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (3, 1, 2)


def test_given_a_rank_up_to_511_then_it_is_counted(store: MetricsStore) -> None:
    _note(store, T0, step=0, ranks={0, 255, 511}, world_size=512)
    _note(store, T0, step=0, ranks={511, 510}, world_size=512)
    assert _run(store).ranks_reporting == 4


def test_given_activities_in_any_order_or_twice_then_the_record_is_the_same(store: MetricsStore) -> None:
    rng = random.Random(15)
    activities = [
        RunActivity(
            T0 + rng.randrange(50) / 4,
            rng.choice([None, *range(6)]),
            frozenset(rng.sample(range(8), rng.randrange(4))),
            rng.choice([None, 4, 8]),
        )
        for _ in range(60)
    ]
    for activity in sorted(activities, key=lambda a: (a.time, a.step or -1)):
        store.note_activity(PROJECT, "in-order", activity)
    shuffled = activities * 2  # and each noted twice
    rng.shuffle(shuffled)
    for activity in shuffled:
        store.note_activity(PROJECT, "shuffled", activity)

    top = max(a.step for a in activities if a.step is not None)
    at_top = [a for a in activities if a.step == top]
    sizes = [a.world_size for a in at_top if a.world_size is not None]
    expected = RunRecord(
        run_id="",
        created=0.0,
        last_event=max(a.time for a in activities),
        last_step=top,
        world_size=max(sizes) if sizes else None,
        ranks_reporting=len(frozenset().union(*(a.ranks for a in at_top))),
    )
    # ``created`` is the first activity's time (set once), the one thing the order decides; a store may
    # leave the time of a note with a step part out when it is within ``run_time_resolution_s`` of the
    # recorded one (DynamoDB: 1 s; SQLite: 0, every time as it comes).
    for run in ("in-order", "shuffled"):
        got = _run(store, run)
        assert expected.last_event - store.run_time_resolution_s <= got.last_event <= expected.last_event
        assert _without(got, "run_id", "created", "last_event") == _without(
            expected, "run_id", "created", "last_event"
        )
    assert _run(store, "in-order").created == min(a.time for a in activities)
    assert _run(store, "shuffled").created == shuffled[0].time


# update_run


def test_given_a_new_run_when_updated_then_it_is_made_and_the_answer_is_the_record(
    store: MetricsStore,
) -> None:
    answer = store.update_run(PROJECT, RUN, T0, config='{"lr": 0.001}')

    assert _without(answer, "received") == RunRecord(
        run_id=RUN, created=T0, last_event=T0, config='{"lr": 0.001}'
    )
    assert store.get_run(PROJECT, RUN) == answer

    finished = store.update_run(PROJECT, "run-b", T0 + 1, finished=True)
    assert _without(finished, "received") == RunRecord(
        run_id="run-b", created=T0 + 1, last_event=T0 + 1, finished=T0 + 1
    )


def test_given_configs_then_the_last_written_wins_and_time_counts_as_activity(store: MetricsStore) -> None:
    _note(store, T0 + 10, step=3, ranks={0}, world_size=1)

    first = store.update_run(PROJECT, RUN, T0 + 5, config='{"a": 1}')  # older than the last event
    assert (first.config, first.created, first.last_event) == ('{"a": 1}', T0 + 10, T0 + 10)
    assert first.last_step == 3

    second = store.update_run(PROJECT, RUN, T0 + 20, config='{"a": 2}')
    assert (second.config, second.last_event) == ('{"a": 2}', T0 + 20)
    third = store.update_run(PROJECT, RUN, T0 + 1, config='{"a": 3}')
    assert (third.config, third.last_event) == ('{"a": 3}', T0 + 20)
    assert store.get_run(PROJECT, RUN) == third

    untouched = store.update_run(PROJECT, RUN, T0 + 2)  # nothing to set: the record as it is
    assert _without(untouched, "received") == _without(third, "received")
    assert store.update_run(PROJECT, RUN, T0 + 30).last_event == T0 + 30


def test_given_finished_twice_then_the_first_time_counts_and_the_config_is_kept(store: MetricsStore) -> None:
    store.update_run(PROJECT, RUN, T0, config='{"model": "gpt2"}')

    first = store.update_run(PROJECT, RUN, T0 + 10, finished=True)
    assert (first.finished, first.config) == (T0 + 10, '{"model": "gpt2"}')
    again = store.update_run(PROJECT, RUN, T0 + 20, finished=True)
    assert (again.finished, again.last_event) == (T0 + 10, T0 + 20)
    late = store.update_run(PROJECT, RUN, T0 + 15, finished=True, config='{"model": "t5"}')
    assert (late.finished, late.last_event, late.config) == (T0 + 10, T0 + 20, '{"model": "t5"}')

    _note(store, T0 + 30, step=1, ranks={0}, world_size=1)  # events after finishing: still finished
    assert _run(store).finished == T0 + 10


def test_given_finished_with_an_old_time_then_finished_is_that_time(store: MetricsStore) -> None:
    _note(store, T0 + 10)
    record = store.update_run(PROJECT, RUN, T0 + 5, finished=True)
    assert (record.finished, record.last_event) == (T0 + 5, T0 + 10)


def test_given_hosts_of_ranks_then_each_rank_keeps_its_last_and_the_others_stay(store: MetricsStore) -> None:
    _note(store, T0, step=3, ranks={0, 1}, world_size=64)
    assert _run(store).hosts is None  # no rank has said
    store.update_run(PROJECT, RUN, T0 + 1, hosts={0: "node-a", 1: "node-a"})
    store.update_run(PROJECT, RUN, T0 + 2, hosts={33: "node-b"})  # another rank group (ranks 32-63)
    record = store.update_run(PROJECT, RUN, T0 + 3, hosts={1: "node-c", 511: "node-z"}, config='{"a": 1}')
    assert record.hosts == {0: "node-a", 1: "node-c", 33: "node-b", 511: "node-z"}
    assert (record.config, record.last_step, record.ranks_reporting) == ('{"a": 1}', 3, 2)
    _note(store, T0 + 4, step=4, ranks={0}, world_size=64)  # events change no host
    assert _run(store).hosts == {0: "node-a", 1: "node-c", 33: "node-b", 511: "node-z"}
    listed = store.list_runs(PROJECT, 10)
    assert [r.hosts for r in listed] == [_run(store).hosts]


# note_findings


def test_given_findings_then_newer_ones_replace_older_and_unknown_runs_get_none(store: MetricsStore) -> None:
    store.note_findings(PROJECT, RUN, '{"warning": 1}', T0)
    assert store.get_run(PROJECT, RUN) is None  # no record made

    _note(store, T0, step=1, ranks={0}, world_size=1)
    store.note_findings(PROJECT, RUN, '{"warning": 1}', T0 + 10)
    assert (_run(store).findings, _run(store).findings_at) == ('{"warning": 1}', T0 + 10)

    store.note_findings(PROJECT, RUN, '{"critical": 2}', T0 + 5)  # an older summary
    assert (_run(store).findings, _run(store).findings_at) == ('{"warning": 1}', T0 + 10)

    store.note_findings(PROJECT, RUN, '{"info": 3}', T0 + 11)
    before = _run(store)
    assert (before.findings, before.findings_at) == ('{"info": 3}', T0 + 11)
    assert (before.last_event, before.last_step, before.created) == (T0, 1, T0)  # nothing else moved


# list_runs


def _make_runs(store: MetricsStore, times: dict[str, float], project: str = PROJECT) -> None:
    for run, time in times.items():
        _note(store, time, step=1, ranks={0}, world_size=1, run=run, project=project)


def _ids(records: list[RunRecord]) -> list[str]:
    return [record.run_id for record in records]


def test_given_runs_then_they_are_listed_newest_first_ties_by_larger_run_id(store: MetricsStore) -> None:
    _make_runs(store, {"a": T0 + 1, "b": T0 + 3, "c": T0 + 2, "d": T0 + 3, "e": T0})
    _make_runs(store, {"z": T0 + 100}, project="other")

    assert _ids(store.list_runs(PROJECT, 50)) == ["d", "b", "c", "a", "e"]
    assert _ids(store.list_runs(PROJECT, 2)) == ["d", "b"]
    assert _ids(store.list_runs(PROJECT, 1)) == ["d"]
    assert _ids(store.list_runs("other", 50)) == ["z"]
    assert store.list_runs("nobody", 50) == []


def test_given_listed_runs_then_each_record_equals_get_run_with_config_and_findings(
    store: MetricsStore,
) -> None:
    _make_runs(store, {"a": T0, "b": T0 + 1})
    store.update_run(PROJECT, "a", T0, config='{"lr": 0.1}')
    store.note_findings(PROJECT, "b", '{"warning": 2}', T0 + 1)
    store.update_run(PROJECT, "b", T0 + 1, finished=True)

    # The list carries what the runs page shows (not the watch's clock nor its state: DynamoDB's
    # ``by_activity`` index does not hold them).
    listed = [_without(record, "received", "watch") for record in store.list_runs(PROJECT, 10)]

    assert listed == [_run(store, "b"), _run(store, "a")]
    assert (listed[0].findings, listed[0].finished, listed[0].config) == ('{"warning": 2}', T0 + 1, None)
    assert (listed[1].config, listed[1].ranks_reporting, listed[1].world_size) == ('{"lr": 0.1}', 1, 1)


def test_given_25_runs_when_paged_by_10_with_the_cursor_then_each_run_comes_once_in_order(
    store: MetricsStore,
) -> None:
    # Groups of three runs share a last_event, so pages end inside a tie.
    times = {f"run-{i:02d}": T0 + i // 3 for i in range(25)}
    rng = random.Random(7)
    order = list(times)
    rng.shuffle(order)
    _make_runs(store, {run: times[run] for run in order})
    _make_runs(store, {f"run-{i:02d}": T0 + 1 for i in range(5)}, project="other")

    pages: list[list[RunRecord]] = []
    after = None
    while True:
        page = store.list_runs(PROJECT, 10, after=after)
        if not page:
            break
        pages.append(page)
        after = (page[-1].last_event, page[-1].run_id)

    assert [len(page) for page in pages] == [10, 10, 5]
    expected = sorted(times, key=lambda run: (times[run], run), reverse=True)
    assert [record.run_id for page in pages for record in page] == expected


def test_given_a_cursor_then_only_runs_strictly_after_it_are_listed(store: MetricsStore) -> None:
    _make_runs(store, {"a": T0, "b": T0 + 1, "c": T0 + 1, "d": T0 + 2})

    assert _ids(store.list_runs(PROJECT, 10, after=(T0 + 1, "c"))) == ["b", "a"]
    assert _ids(store.list_runs(PROJECT, 10, after=(T0 + 1, "b"))) == ["a"]
    assert _ids(store.list_runs(PROJECT, 10, after=(T0 + 1, "bb"))) == ["b", "a"]
    assert _ids(store.list_runs(PROJECT, 10, after=(T0 + 5, ""))) == ["d", "c", "b", "a"]
    assert store.list_runs(PROJECT, 10, after=(T0, "a")) == []


def test_given_live_idle_and_finished_runs_then_the_status_filter_lists_each_kind(
    store: MetricsStore,
) -> None:
    idle_before = T0 + 10
    _make_runs(store, {"idle-1": T0, "idle-2": T0 + 9.5, "live-1": T0 + 10, "live-2": T0 + 20})
    _make_runs(store, {"done-old": T0 + 1, "done-new": T0 + 30})
    store.update_run(PROJECT, "done-old", T0 + 1, finished=True)
    store.update_run(PROJECT, "done-new", T0 + 30, finished=True)
    _make_runs(store, {"live-other": T0 + 50, "idle-other": T0}, project="other")

    def listed(*statuses: RunStatus, after: tuple[float, str] | None = None, limit: int = 50) -> list[str]:
        wanted = frozenset(statuses)
        return _ids(store.list_runs(PROJECT, limit, after=after, statuses=wanted, idle_before=idle_before))

    everything = ["done-new", "live-2", "live-1", "idle-2", "done-old", "idle-1"]
    assert _ids(store.list_runs(PROJECT, 50, idle_before=idle_before)) == everything
    assert listed("live", "idle", "finished") == everything
    assert listed("live") == ["live-2", "live-1"]
    assert listed("idle") == ["idle-2", "idle-1"]
    assert listed("finished") == ["done-new", "done-old"]
    assert listed("live", "idle") == ["live-2", "live-1", "idle-2", "idle-1"]
    assert listed("live", "finished") == ["done-new", "live-2", "live-1", "done-old"]
    assert listed("idle", "finished") == ["done-new", "idle-2", "done-old", "idle-1"]
    assert listed() == []

    assert listed("live", limit=1) == ["live-2"]
    assert listed("live", after=(T0 + 20, "live-2")) == ["live-1"]
    assert listed("live", after=(T0 + 10, "live-1")) == []
    assert listed("live", after=(T0 + 5, "x")) == []
    assert listed("idle", after=(T0 + 50, "x")) == ["idle-2", "idle-1"]
    assert listed("idle", after=(T0 + 9.5, "idle-2")) == ["idle-1"]
    assert listed("finished", after=(T0 + 30, "done-new")) == ["done-old"]
    assert listed("idle", "finished", limit=2) == ["done-new", "idle-2"]
    assert listed("idle", "finished", after=(T0 + 9.5, "idle-2"), limit=1) == ["done-old"]


def test_given_many_finished_runs_when_unfinished_are_listed_then_short_pages_do_not_end_the_list(
    store: MetricsStore,
) -> None:
    """A filter can leave the store's pages short or empty; the list goes on to ``limit``."""
    for i in range(150):
        store.update_run(PROJECT, f"done-{i:03d}", T0 + 100 + i, finished=True)
    _make_runs(store, {"live": T0 + 50, "idle": T0})

    assert _ids(store.list_runs(PROJECT, 2, statuses=frozenset({"live", "idle"}), idle_before=T0 + 10)) == [
        "live",
        "idle",
    ]
    assert len(store.list_runs(PROJECT, 200, statuses=frozenset({"finished"}))) == 150


def test_given_105_runs_of_one_time_when_paged_by_50_then_each_comes_once_by_run_id(
    store: MetricsStore,
) -> None:
    """Ties across the store's own pages: DynamoDB's index does not order equal times."""
    runs = [f"r{i:03d}" for i in range(105)]
    _make_runs(store, dict.fromkeys(runs, T0))

    seen: list[str] = []
    after = None
    while page := store.list_runs(PROJECT, 50, after=after):
        seen += _ids(page)
        after = (page[-1].last_event, page[-1].run_id)

    assert seen == sorted(runs, reverse=True)


# What only the DynamoDB adapter must watch: the attributes and partitions its roles allow


@pytest.fixture
def dynamo_calls(metrics_table: str) -> Iterator[tuple[DynamoStore, list[tuple[str, dict[str, Any]]]]]:
    """A DynamoStore made as ``infra/local/triggers.py`` makes one, and every request its client sends."""
    import boto3

    client = boto3.client("dynamodb")
    calls: list[tuple[str, dict[str, Any]]] = []

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append((model.name, params))

    client.meta.events.register("provide-client-params.dynamodb.*", record)
    yield DynamoStore(metrics_table, client, "test-runs"), calls


def test_dynamodb_note_findings_names_only_the_attributes_the_summarize_role_may_touch(
    dynamo_calls: tuple[DynamoStore, list[tuple[str, dict[str, Any]]]],
) -> None:
    store, calls = dynamo_calls
    _note(store, T0, step=1, ranks={0}, world_size=1)
    calls.clear()

    store.note_findings(PROJECT, RUN, '{"info": 1}', T0)
    store.note_findings(PROJECT, RUN, '{"info": 2}', T0 - 1)  # refused by its condition
    store.note_findings(PROJECT, "unknown", '{"info": 3}', T0)

    assert [name for name, _ in calls] == ["UpdateItem"] * 3
    for _, params in calls:
        assert params["TableName"] == "test-runs"
        assert set(params["Key"]) | set(params["ExpressionAttributeNames"].values()) <= {
            "project",
            "run_id",
            "findings",
            "findings_at",
        }
        assert params.get("ReturnValues", "NONE") == "NONE"
    assert _run(store).findings == '{"info": 1}'
    assert store.get_run(PROJECT, "unknown") is None


def test_dynamodb_runs_reads_use_only_what_the_runs_role_allows(
    dynamo_calls: tuple[DynamoStore, list[tuple[str, dict[str, Any]]]],
) -> None:
    """GetItem, BatchGetItem and Query of the runs table and its index (a run's items: its own, config
    and rank groups, never another run's); Query of ``@scalars#`` only."""
    store, calls = dynamo_calls
    _make_runs(store, {"a": T0, "b": T0 + 1})
    store.update_run(PROJECT, "a", T0, config='{"x": 1}')
    calls.clear()

    assert store.get_run(PROJECT, "a") is not None
    assert [r.config for r in store.list_runs(PROJECT, 10)] == [None, '{"x": 1}']
    assert store.read_scalars(PROJECT, "a").events == []
    assert store.read_scalars(PROJECT, "a", max_items=5).events == []

    assert {name for name, _ in calls} <= {"GetItem", "BatchGetItem", "Query"}
    for name, params in calls:
        if name == "Query" and params["TableName"] == "test-metrics":
            assert params["ExpressionAttributeValues"][":pk"]["S"].startswith("@scalars#")
        elif name == "Query" and "IndexName" not in params:
            assert params["TableName"] == "test-runs"
            values = params["ExpressionAttributeValues"]
            run_id = values[":low"]["S"].partition("#")[0]
            assert values[":p"]["S"] in (f"{PROJECT}#{run_id}", PROJECT)  # its own, or the earlier layout's
            assert values[":high"]["S"] == run_id + "#\U0010ffff"
        elif name == "Query":
            assert params["TableName"] == "test-runs"
            assert params["IndexName"] in ("by_project", "by_activity")
        elif name == "BatchGetItem":
            assert set(params["RequestItems"]) == {"test-runs"}
        else:
            assert params["TableName"] == "test-runs"


def test_dynamodb_a_note_writes_only_the_rank_groups_it_touches_once_the_run_s_time_is_recorded(
    dynamo_calls: tuple[DynamoStore, list[tuple[str, dict[str, Any]]]],
) -> None:
    """The run's own item (both indexes hold it) is written for a newer time only; the config is never
    rewritten with the activity; a rank group is written once by each of its ranks' notes, whatever its
    other ranks did (each rank grows its own attributes: no condition fails for another rank's note)."""
    store, calls = dynamo_calls
    _note(store, T0, step=1, ranks={0}, world_size=512)
    store.update_run(PROJECT, RUN, T0, config='{"big": "' + "x" * 60_000 + '"}')
    calls.clear()

    _note(store, T0, step=1, ranks={1}, world_size=512)
    _note(store, T0, step=2, ranks={40, 41}, world_size=512)
    _note(store, T0, step=1, ranks={2}, world_size=512)  # behind the run's step: still its own rank's
    written = [params["Key"]["run_id"]["S"] for _, params in calls]
    assert written == [f"{RUN}#s00", f"{RUN}#s01", f"{RUN}#s00"]
    assert all(name == "UpdateItem" and "ReturnValues" not in params for name, params in calls)
    assert (_run(store).last_step, _run(store).ranks_reporting, _run(store).world_size) == (2, 2, 512)

    calls.clear()
    _note(store, T0 + 5, step=2, ranks={42}, world_size=512)
    assert [params["Key"]["run_id"]["S"] for _, params in calls] == [RUN, f"{RUN}#s01"]
    assert len(_run(store).config or "") > 60_000


@pytest.mark.slow
def test_dynamodb_512_ranks_reporting_within_a_second_write_the_run_s_item_once(
    dynamo_calls: tuple[DynamoStore, list[tuple[str, dict[str, Any]]]],
) -> None:
    """Through the ingest's notes (time held back up to a second): one write of the run's own item per
    second, the 512 ranks' step spread over 16 rank groups."""
    from shared.ingest.activity import ActivityNotes

    store, calls = dynamo_calls
    notes = ActivityNotes(store.run_time_resolution_s)
    for step in range(2):
        for rank in range(512):
            at = T0 + step * 0.2 + rank / 5120
            notes.note(store, PROJECT, RUN, RunActivity(at, step, frozenset({rank}), 512))
    keys = [params["Key"]["run_id"]["S"] for _, params in calls]
    assert keys.count(RUN) == 1
    groups = {key for key in keys if key != RUN}
    assert len(groups) == 16
    assert len(keys) - 1 == 2 * 512  # one update a rank's note, none failing
    record = _run(store)
    assert (record.last_step, record.ranks_reporting, record.world_size) == (1, 512, 512)
    assert record.last_event == T0  # held: the next write of the run's item is a second on


def test_dynamodb_runs_table_comes_from_the_environment_when_not_given(metrics_table: str) -> None:
    store = DynamoStore(metrics_table)
    assert store.runs_table == "test-runs"
    _note(store, T0)
    assert DynamoStore(metrics_table, runs_table="test-runs").get_run(PROJECT, RUN) is not None


# A database made before run records (SQLite only)

_OLD_SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY, project TEXT NOT NULL, run_id TEXT NOT NULL, UNIQUE (project, run_id));
CREATE TABLE events (
    run INTEGER NOT NULL, step INTEGER NOT NULL, event_id TEXT NOT NULL, rank INTEGER NOT NULL,
    world_size INTEGER NOT NULL, local_rank INTEGER, keys TEXT NOT NULL, v BLOB NOT NULL, h BLOB NOT NULL);
CREATE UNIQUE INDEX events_by_step ON events (run, step, event_id);
"""


@pytest.mark.parametrize("reopen", [False, True])
def test_given_a_database_made_before_run_records_when_opened_then_its_runs_have_records(
    tmp_path: Path, reopen: bool
) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(_OLD_SCHEMA)
    runs = {"old-a": 1, "old-b": 2, "empty": 3}
    conn.executemany(
        "INSERT INTO runs (id, project, run_id) VALUES (?, ?, ?)",
        [(number, PROJECT, run) for run, number in runs.items()],
    )

    def insert(run: str, step: int, rank: int, world_size: int, time: float) -> None:
        v = struct.pack("<3d", 1.0, time, 0.5)
        conn.execute(
            "INSERT INTO events (run, step, event_id, rank, world_size, local_rank, keys, v, h)"
            " VALUES (?, ?, ?, ?, ?, NULL, 'train/loss', ?, ?)",
            (runs[run], step, f"{run}-s{step}-r{rank}", rank, world_size, v, b"\0" * 16),
        )

    for step in range(3):
        for rank in range(4):
            insert("old-a", step, rank, 4, T0 + step + rank / 10)
    insert("old-a", 3, 2, 4, T0 + 2.5)  # the last step, one rank so far, older than step 2's last
    insert("old-b", 7, 0, 2, T0 + 100)
    insert("old-b", 7, 1, 2, T0 + 101)
    conn.commit()
    conn.close()

    store = SqliteStore(path)
    if reopen:  # the second open finds the columns and changes nothing
        store.db.close()
        store = SqliteStore(path)

    assert store.get_run(PROJECT, "old-a") == RunRecord(
        run_id="old-a", created=T0, last_event=T0 + 2.5, last_step=3, world_size=4, ranks_reporting=1
    )
    assert store.get_run(PROJECT, "old-b") == RunRecord(
        run_id="old-b", created=T0 + 100, last_event=T0 + 101, last_step=7, world_size=2, ranks_reporting=2
    )
    assert store.get_run(PROJECT, "empty") is None
    assert _ids(store.list_runs(PROJECT, 10)) == ["old-b", "old-a"]
    assert len(store.read_events(PROJECT, "old-a").events) == 13

    _note(store, T0 + 200, step=8, ranks={0}, world_size=2, run="old-b")  # and the records go on
    assert (_run(store, "old-b").last_step, _run(store, "old-b").created) == (8, T0 + 100)


def test_given_an_old_database_whose_last_step_is_not_its_latest_event_then_last_event_is_the_latest(
    tmp_path: Path,
) -> None:
    """``last_event`` is the latest event time (what ``note_activity`` would have recorded), also when a
    late rank's event of an earlier step came after the last step's."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(_OLD_SCHEMA)
    conn.execute("INSERT INTO runs (id, project, run_id) VALUES (1, ?, ?)", (PROJECT, RUN))
    for step, rank, time in ((1, 0, T0), (2, 0, T0 + 1), (1, 1, T0 + 5)):  # rank 1 is late with step 1
        conn.execute(
            "INSERT INTO events (run, step, event_id, rank, world_size, local_rank, keys, v, h)"
            " VALUES (1, ?, ?, ?, 2, NULL, 'a', ?, ?)",
            (step, f"s{step}-r{rank}", rank, struct.pack("<3d", 1.0, time, 0.5), b"\0" * 16),
        )
    conn.commit()
    conn.close()

    record = _run(SqliteStore(path))

    assert (record.created, record.last_event, record.last_step, record.ranks_reporting) == (T0, T0 + 5, 2, 1)


@pytest.mark.slow
def test_dynamodb_what_ingest_sends_for_a_run_s_notes_updates_and_processes_its_role_allows(
    dynamo_calls: tuple[DynamoStore, list[tuple[str, dict[str, Any]]]],
) -> None:
    """The ingest function's role (template.yaml, as deployed: SAM's transform) against the calls the
    store makes for what ingest does to the runs table: notes, a run update, process records (a process's
    document is read, then written conditional on its version)."""
    from infra import template
    from tests.unit.test_template import permissions

    store, calls = dynamo_calls
    _note(store, T0, step=1, ranks={0, 40}, world_size=64)
    store.update_run(PROJECT, RUN, T0 + 1, config='{"x": 1}', hosts={0: "node-a"})
    store.update_process(PROJECT, RUN, 0, lambda kept: '{"state": "started"}' if kept is None else None)
    store.update_process(PROJECT, RUN, 0, lambda kept: '{"state": "ended"}')
    store.update_run(PROJECT, RUN, T0 + 2, finished=True)

    allowed = permissions(template.transformed(), "IngestFunction")
    made = {(f"dynamodb:{name}", params["TableName"]) for name, params in calls}
    tables = {"test-runs": "RunsTable", "test-metrics": "MetricsTable"}
    assert {(action, tables[table]) for action, table in made} <= allowed
    assert ("dynamodb:GetItem", "test-runs") in made  # (the role once lacked it: every process record failed)
