"""The DynamoDB adapter's pure helpers (shared/store/dynamodb/layout/keys.py, codecs.py, expressions.py),
without a table: the keys items live under, items to and from domain types, and the expressions sent, above
all the query that lists a project's runs. tests/contract holds the adapter to the port against moto."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.events import RankEvent, ScalarEvent
from shared.store.dynamodb.layout.codecs import (
    RankStep,
    item_of,
    item_size,
    pack_watch,
    rank_steps,
    run_record,
    stored_event,
    unpack_watch,
    write_units,
)
from shared.store.dynamodb.layout.expressions import (
    RUN_STATUSES,
    ActivityBounds,
    activity_bounds,
    key_range_query,
    names,
    rank_steps_update,
    run_listed,
    runs_index_query,
    with_expires,
)
from shared.store.dynamodb.layout.keys import (
    block_of_sort_key,
    block_partition,
    block_sort_key,
    block_window,
    config_item,
    event_of_key,
    group_item,
    listing_shard,
    listing_shards,
    partition_key,
    process_item,
    project_of_partition,
    rank_groups,
    run_key,
    scalar_partition,
    sort_key,
    step_window,
    watch_shard,
    watch_shards,
)
from shared.store.port import RunRecord

# Ids as the API takes them: no "#" (the keys' separator) and no control characters.
IDS = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")).filter(lambda c: c != "#"), min_size=1
)
STEPS = st.integers(0, 2**53 - 1)


def event(**changes: Any) -> RankEvent:
    fields: dict[str, Any] = {
        "project": "proj",
        "run_id": "run-1",
        "event_id": "e1",
        "step": 42,
        "rank": 17,
        "world_size": 32,
        "local_rank": None,
        "weight": 1.0,
        "time": 1.5,
        "keys": ("loss", "lr"),
        "values": (2.0, 0.5),
        "payload_digest": b"d" * 16,
    }
    return RankEvent(**(fields | changes))


# Keys


def test_event_keys_are_the_documented_layout() -> None:
    assert partition_key("proj", "run-1", 10) == "proj#run-1#0a"
    assert sort_key(42, "e1") == "0000000000000042#e1"
    assert scalar_partition("proj", "run-1") == "@scalars#proj#run-1"
    assert step_window(5, None) == ("0000000000000005#", "9999999999999999#\U0010ffff")
    assert step_window(0, 7) == ("0000000000000000#", "0000000000000007#\U0010ffff")


@given(IDS.filter(lambda p: not p.startswith("@")), IDS, st.integers(0, 15), STEPS, IDS)
def test_an_event_item_s_keys_give_back_its_run_and_step(
    project: str, run_id: str, shard: int, step: int, event_id: str
) -> None:
    assert event_of_key(partition_key(project, run_id, shard), sort_key(step, event_id)) == (
        project,
        run_id,
        step,
    )


@given(IDS, IDS, STEPS)
def test_no_rollup_or_scalar_item_is_taken_for_an_event(project: str, run_id: str, step: int) -> None:
    assert event_of_key(scalar_partition(project, run_id), sort_key(step, "e")) is None
    assert event_of_key(block_partition(project, run_id), block_sort_key(10, step)) is None


@given(st.integers(1, 99_999), STEPS)
def test_a_block_s_sort_key_gives_back_its_number(size: int, block: int) -> None:
    assert block_of_sort_key(block_sort_key(size, block)) == block


def test_a_block_window_is_one_level_s_range_with_the_last_block_capped() -> None:
    assert block_window(100, 3, 7) == ("00100:0000000000000003", "00100:0000000000000007")
    assert block_window(100, 0, 10**20) == ("00100:0000000000000000", "00100:9999999999999999")


def test_ranks_fall_into_groups_of_32_and_a_step_without_ranks_into_its_own() -> None:
    assert rank_groups(frozenset({0, 31, 32, 511})) == [
        ("00", frozenset({0, 31})),
        ("01", frozenset({32})),
        ("15", frozenset({511})),
    ]
    assert rank_groups(frozenset()) == [("-", frozenset())]


def test_a_run_s_watch_shard_is_a_stable_hash_of_its_keys() -> None:
    assert watch_shards() == ["w0", "w1", "w2", "w3"]
    # crc32("{project}#{run_id}") % 4: the same in every process (Python's hash is not)
    assert [watch_shard("proj", f"run-{n}") for n in (1, 2, 4)] == ["w3", "w1", "w0"]


# Codecs


def test_an_event_s_item_is_the_documented_layout() -> None:
    item = item_of(event(local_rank=1), expires=1_800_000_000)
    assert item == {
        "pk": {"S": "proj#run-1#01"},
        "sk": {"S": "0000000000000042#e1"},
        "r": {"N": "17"},
        "ws": {"N": "32"},
        "k": {"S": "loss\nlr"},
        "v": {"B": struct.pack("<4d", 1.0, 1.5, 2.0, 0.5)},
        "h": {"B": b"d" * 16},
        "lr": {"N": "1"},
        "expires": {"N": "1800000000"},
    }
    assert "lr" not in item_of(event()) and "expires" not in item_of(event())


def test_a_scalar_s_item_is_an_event_s_in_its_run_s_scalars_partition_with_no_world_and_weight_1() -> None:
    scalar = ScalarEvent("proj", "run-1", "s1", 3, 0, 2.5, ("lr",), (0.1,), b"s" * 16)
    assert item_of(scalar, scalar_partition("proj", "run-1")) == {
        "pk": {"S": "@scalars#proj#run-1"},
        "sk": {"S": "0000000000000003#s1"},
        "r": {"N": "0"},
        "ws": {"N": "0"},
        "k": {"S": "lr"},
        "v": {"B": struct.pack("<3d", 1.0, 2.5, 0.1)},
        "h": {"B": b"s" * 16},
    }


def test_an_item_s_size_counts_names_and_values_and_a_write_unit_is_a_started_kb() -> None:
    item = item_of(event())
    # names 2+2+1+2+1+1+1, values 13+19+2+2+7+32+16, numbers "17" and "32" 2 bytes each
    assert item_size(item) == 10 + 13 + 19 + 2 + 2 + 7 + 32 + 16
    assert write_units(item) == 1
    assert item_size({"n": {"N": "-123.45"}}) == 1 + (1 + 3)  # five digits: one byte per two, plus one
    big = item_of(event(keys=tuple(f"k{i:03d}" for i in range(130)), values=(1.0,) * 130))
    # the keys 130 x 4 characters and 129 newlines, the values (2 + 130) x 8 bytes
    assert item_size(big) == 10 + 13 + 19 + 2 + 2 + 649 + 1056 + 16
    assert write_units(big) == 2


@pytest.mark.slow
@given(
    st.integers(0, 1023),
    STEPS,
    st.none() | st.integers(0, 7),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=5),
    IDS,
)
def test_a_stored_event_reads_back_what_the_item_was_made_from(
    rank: int, step: int, local_rank: int | None, values: list[float], event_id: str
) -> None:
    keys = tuple(f"key/{i}" for i in range(len(values)))
    sent = event(
        rank=rank, step=step, local_rank=local_rank, keys=keys, values=tuple(values), event_id=event_id
    )
    read = stored_event(item_of(sent))
    assert (read.event_id, read.step, read.rank, read.world_size, read.local_rank) == (
        event_id,
        step,
        rank,
        32,
        local_rank,
    )
    assert read.keys == list(keys)
    weight, time, *got = struct.unpack(f"<{2 + len(values)}d", read.packed)
    assert (weight, time) == (1.0, 1.5)
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, values, strict=True))
    assert read.packed == struct.pack(f"<{2 + len(values)}d", 1.0, 1.5, *values)  # bit for bit


@given(st.text())
def test_the_watch_s_state_reads_back_as_written(state: str) -> None:
    assert unpack_watch({"B": pack_watch(state)}) == state


def test_the_watch_s_state_is_compressed_and_its_older_plain_text_still_reads() -> None:
    state = '{"findings": []}' * 100
    assert len(pack_watch(state)) < len(state) // 10
    assert unpack_watch({"S": "plain"}) == "plain"


def test_a_rank_group_s_item_records_each_rank_s_step_and_an_older_run_item_its_own() -> None:
    group = {"run_id": {"S": "r#s00"}, "s3": {"N": "7"}, "w3": {"N": "8"}, "s4": {"N": "6"}, "sn": {"N": "9"}}
    assert sorted(rank_steps(group), key=str) == sorted(
        [RankStep(7, 3, 8), RankStep(6, 4, None), RankStep(9, None, None)], key=str
    )
    older = {"last_step": {"N": "5"}, "world_size": {"N": "2"}, "ranks": {"NS": ["0", "1"]}}
    assert rank_steps(older) == [RankStep(5, None, 2), RankStep(5, 0, 2), RankStep(5, 1, 2)]


def test_a_run_s_record_merges_its_config_and_rank_groups() -> None:
    main: dict[str, Any] = {
        "run_id": {"S": "r"},
        "last_event": {"N": "20.5"},
        "created": {"N": "10"},
        "finished": {"N": "21"},
        "findings": {"S": '{"warning": 1}'},
        "watch": {"B": pack_watch('{"open": []}')},
    }
    others: list[dict[str, Any]] = [
        main,
        {"run_id": {"S": "r#config"}, "config": {"S": '{"lr": 0.1}'}},
        {
            "run_id": {"S": "r#s00"},
            "s0": {"N": "9"},
            "w0": {"N": "64"},
            "s1": {"N": "8"},
            "h0": {"S": "node-a"},
        },
        {"run_id": {"S": "r#s01"}, "s32": {"N": "9"}, "w32": {"N": "48"}, "h33": {"S": "node-b"}},
        {"run_id": {"S": "rx"}, "s0": {"N": "99"}},  # another run's id: not this run's group
    ]
    assert run_record(main, others) == RunRecord(
        run_id="r",
        created=10.0,
        last_event=20.5,
        last_step=9,
        world_size=64,
        ranks_reporting=2,
        finished=21.0,
        config='{"lr": 0.1}',
        findings='{"warning": 1}',
        watch='{"open": []}',
        hosts={0: "node-a", 33: "node-b"},
    )
    # An index entry alone: no groups, and a run created at its only event.
    assert run_record({"run_id": {"S": "r"}, "last_event": {"N": "3"}}) == RunRecord("r", 3.0, 3.0)


# Expressions


def test_a_request_names_exactly_the_aliases_its_expressions_use() -> None:
    assert names("SET #le = :t, #s12 = :s REMOVE #wn", "attribute_exists(#r) AND #h3 = :h") == {
        "#le": "last_event",
        "#s12": "s12",
        "#wn": "wn",
        "#r": "run_id",
        "#h3": "h3",
    }
    with pytest.raises(KeyError):
        names("SET #nope = :x")


def test_an_update_sets_expires_only_with_a_retention() -> None:
    values: dict[str, Any] = {}
    assert with_expires("SET #le = :t", values, None) == "SET #le = :t" and values == {}
    assert with_expires("SET #le = :t", values, 99) == "SET #exp = :exp, #le = :t"
    assert values == {":exp": {"N": "99"}}
    assert with_expires("REMOVE #hl", {}, 99) == "REMOVE #hl SET #exp = :exp"


def test_a_rank_steps_update_grows_each_rank_s_step_and_sets_or_removes_its_world_size() -> None:
    assert rank_steps_update([3, 4], 7, 8) == (
        "SET #s3 = :s, #w3 = :ws, #s4 = :s, #w4 = :ws",
        {":s": {"N": "7"}, ":ws": {"N": "8"}},
        "(attribute_not_exists(#s3) OR #s3 < :s) AND (attribute_not_exists(#s4) OR #s4 < :s)",
    )
    assert rank_steps_update([None], 7, None) == (
        "SET #sn = :s REMOVE #wn",
        {":s": {"N": "7"}},
        "(attribute_not_exists(#sn) OR #sn < :s)",
    )


def test_a_key_range_query_reads_one_partition_between_two_sort_keys() -> None:
    assert key_range_query("T", "p#r#00", "a", "b") == {
        "TableName": "T",
        "KeyConditionExpression": "#pk = :pk AND #sk BETWEEN :low AND :high",
        "ExpressionAttributeNames": {"#pk": "pk", "#sk": "sk"},
        "ExpressionAttributeValues": {":pk": {"S": "p#r#00"}, ":low": {"S": "a"}, ":high": {"S": "b"}},
    }


def test_the_runs_listing_query_reads_the_index_newest_first_in_pages_of_at_least_100() -> None:
    assert runs_index_query("proj@3", 5, RUN_STATUSES, 100.0, None) == {
        "IndexName": "by_project",
        "KeyConditionExpression": "#lsh = :p",
        "ScanIndexForward": False,
        "Limit": 100,
        "ExpressionAttributeNames": {"#lsh": "listing_shard"},
        "ExpressionAttributeValues": {":p": {"S": "proj@3"}},
    }
    query = runs_index_query("proj", 250, frozenset({"live"}), 100.0, 150.0, legacy=True)
    assert query == {
        "IndexName": "by_activity",
        "KeyConditionExpression": "#p = :p AND #le BETWEEN :low AND :high",
        "ScanIndexForward": False,
        "Limit": 251,
        "FilterExpression": "attribute_not_exists(#fin)",
        "ExpressionAttributeNames": {"#p": "project", "#le": "last_event", "#fin": "finished"},
        "ExpressionAttributeValues": {":p": {"S": "proj"}, ":low": {"N": "100.0"}, ":high": {"N": "150.0"}},
    }


def test_a_run_s_items_live_in_its_own_partition_and_its_listing_shard_is_a_stable_hash() -> None:
    assert run_key("proj", "run-1") == {"project": {"S": "proj#run-1"}, "run_id": {"S": "run-1"}}
    for item in (config_item("run-1"), group_item("run-1", "03"), process_item("run-1", 7)):
        assert run_key("proj", item)["project"] == {"S": "proj#run-1"}, item
    assert run_key("proj", "run-1", legacy=True)["project"] == {"S": "proj"}
    assert project_of_partition("proj#run-1", "run-1") == "proj"
    assert project_of_partition("proj", "run-1") == "proj"  # the earlier layout's
    assert listing_shards("proj") == [f"proj@{n}" for n in range(8)]
    shards = [listing_shard("proj", f"run-{n}") for n in range(100)]
    assert shards[:3] == [listing_shard("proj", f"run-{n}") for n in range(3)]
    assert set(shards) == set(listing_shards("proj"))  # 100 runs reach every shard
    assert max(shards.count(s) for s in set(shards)) <= 25  # and no shard takes a quarter of them


IDLE_BEFORE = 100.0


@pytest.mark.parametrize(
    ("statuses", "cursor", "key", "only", "bounds"),
    [
        (RUN_STATUSES, None, "#p = :p", None, {}),
        (RUN_STATUSES, 50.0, "#p = :p AND #le <= :high", None, {":high": 50.0}),
        ({"live"}, None, "#p = :p AND #le >= :low", "attribute_not_exists(#fin)", {":low": 100.0}),
        ({"idle"}, None, "#p = :p AND #le < :below", "attribute_not_exists(#fin)", {":below": 100.0}),
        # The cursor before idle_before is the stricter bound of the two, and after it the looser one.
        ({"idle"}, 50.0, "#p = :p AND #le <= :high", "attribute_not_exists(#fin)", {":high": 50.0}),
        ({"idle"}, 150.0, "#p = :p AND #le < :below", "attribute_not_exists(#fin)", {":below": 100.0}),
        ({"live", "idle"}, None, "#p = :p", "attribute_not_exists(#fin)", {}),
        ({"finished"}, None, "#p = :p", "attribute_exists(#fin)", {}),
        ({"finished"}, 50.0, "#p = :p AND #le <= :high", "attribute_exists(#fin)", {":high": 50.0}),
        ({"live", "finished"}, None, "#p = :p", None, {}),
    ],
)
def test_the_runs_listing_query_s_key_condition_and_filter(
    statuses: set[str], cursor: float | None, key: str, only: str | None, bounds: dict[str, float]
) -> None:
    query = runs_index_query("proj", 10, frozenset(statuses), IDLE_BEFORE, cursor, legacy=True)
    assert query is not None
    assert (query["KeyConditionExpression"], query.get("FilterExpression")) == (key, only)
    assert query["ExpressionAttributeValues"] == {":p": {"S": "proj"}} | {
        name: {"N": repr(value)} for name, value in bounds.items()
    }


def test_live_runs_after_a_cursor_older_than_idle_before_are_none_and_no_query_is_sent() -> None:
    assert activity_bounds(frozenset({"live"}), IDLE_BEFORE, 50.0) == ActivityBounds(100.0, 50.0, None)
    assert runs_index_query("proj", 10, frozenset({"live"}), IDLE_BEFORE, 50.0) is None


def test_a_listing_keeps_runs_after_the_cursor_of_the_statuses_wanted() -> None:
    live = RunRecord("b", created=0.0, last_event=150.0)
    idle = RunRecord("a", created=0.0, last_event=50.0)
    done = RunRecord("c", created=0.0, last_event=50.0, finished=60.0)
    assert [run_listed(r, RUN_STATUSES, IDLE_BEFORE, None) for r in (live, idle, done)] == [True] * 3
    assert [run_listed(r, frozenset({"idle"}), IDLE_BEFORE, None) for r in (live, idle, done)] == [
        False,
        True,
        False,
    ]
    # After the cursor (150.0, "b"): older times, or the same time and a smaller run id.
    assert run_listed(live, RUN_STATUSES, IDLE_BEFORE, (150.0, "b")) is False
    assert run_listed(live, RUN_STATUSES, IDLE_BEFORE, (150.0, "c")) is True
    assert run_listed(idle, RUN_STATUSES, IDLE_BEFORE, (150.0, "a")) is True


def matches(query: dict[str, Any] | None, record: RunRecord) -> bool:
    """Whether ``query`` (``runs_index_query``'s) reads ``record``'s index entry."""
    if query is None:
        return False
    values = {
        name: float(value["N"]) for name, value in query["ExpressionAttributeValues"].items() if "N" in value
    }
    at = record.last_event
    within = (
        at >= values.get(":low", -math.inf)
        and at <= values.get(":high", math.inf)
        and at < values.get(":below", math.inf)
    )
    only = query.get("FilterExpression")
    finished = record.finished is not None
    return within and only != ("attribute_exists(#fin)" if not finished else "attribute_not_exists(#fin)")


TIMES = st.sampled_from([0.0, 50.0, 99.5, 100.0, 100.5, 150.0, 200.0])


@given(
    st.frozensets(st.sampled_from(sorted(RUN_STATUSES)), min_size=1),
    st.none() | st.tuples(TIMES, st.sampled_from("abc")),
    TIMES,
    st.sampled_from("abc"),
    st.none() | TIMES,
)
def test_the_runs_listing_query_reads_every_run_the_listing_keeps(
    wanted: frozenset[str],
    after: tuple[float, str] | None,
    last_event: float,
    run_id: str,
    finished: float | None,
) -> None:
    """The key condition and the filter only narrow the reads: a run the listing keeps is always read."""
    record = RunRecord(run_id, created=0.0, last_event=last_event, finished=finished)
    query = runs_index_query("proj", 10, wanted, IDLE_BEFORE, None if after is None else after[0])
    if run_listed(record, wanted, IDLE_BEFORE, after):
        assert matches(query, record)
