"""The SQLite store's rows as the port's values and back (shared/store/sqlite/codecs.py), without a
database: what a row holds comes back as it went in."""

from __future__ import annotations

import json
import math
import struct

from hypothesis import given
from hypothesis import strategies as st

from shared.store.port import Delivery, PendingDelivery, RunActivity, RunRecord, StoredEvent, Webhook
from shared.store.sqlite.codecs import (
    RANK_BITMAP_BYTES,
    event_time,
    merged_hosts,
    noted_activity,
    outbox_row,
    pending_delivery,
    rank_bitmap,
    rank_bits,
    run_record,
    stored_events,
    webhooks_from_text,
    webhooks_text,
)
from shared.store.sqlite.tokens import token_record
from shared.tokens import TokenRecord

KEY = st.text(st.characters(exclude_characters="\n", exclude_categories=["Cs"]), min_size=1, max_size=8)
RANKS = st.frozensets(st.integers(0, RANK_BITMAP_BYTES * 8 - 1), max_size=32)


def test_rows_become_stored_events_field_for_field() -> None:
    rows = [
        ("a", 3, 1, 8, "train/loss\nsystem/step_time", b"\x01" * 24, 1),
        ("b", 4, 2, 8, "train/loss", b"\x02" * 16, None),
    ]

    events = stored_events(rows)

    assert events == [
        StoredEvent("a", 3, 1, 8, ["train/loss", "system/step_time"], b"\x01" * 24, 1),
        StoredEvent("b", 4, 2, 8, ["train/loss"], b"\x02" * 16, None),
    ]
    assert all(type(e) is StoredEvent for e in events)


def test_events_with_the_same_keys_share_one_list() -> None:
    rows = [("a", 1, 0, 2, "x\ny", b"", 0), ("b", 1, 1, 2, "x\ny", b"", 1), ("c", 2, 0, 2, "z", b"", 0)]

    a, b, c = stored_events(rows)

    assert a.keys is b.keys
    assert a.keys == ["x", "y"] and c.keys == ["z"]


def test_no_rows_are_no_events() -> None:
    assert stored_events([]) == []


@given(st.lists(KEY, min_size=1, max_size=5), st.integers(0, 2**40), st.integers(0, 511))
def test_keys_joined_as_the_ingest_loop_joins_them_split_back_unchanged(
    keys: list[str], step: int, rank: int
) -> None:
    # shared.store.sqlite.events joins an event's keys with newlines into its row.
    (event,) = stored_events([("id", step, rank, 512, "\n".join(keys), b"", None)])

    assert (event.keys, event.step, event.rank) == (keys, step, rank)


@given(st.floats(allow_nan=False), st.floats(allow_nan=False), st.lists(st.floats(), max_size=4))
def test_the_time_of_a_packed_event_is_its_second_float(
    weight: float, time: float, values: list[float]
) -> None:
    # Packed as the ingest loop packs it: [weight, time, *values], little-endian float64s.
    packed = struct.pack(f"<{2 + len(values)}d", weight, time, *values)

    assert event_time(packed) == time


def test_event_time_reads_infinity_and_nan_bit_for_bit() -> None:
    assert event_time(struct.pack("<2d", 1.0, math.inf)) == math.inf
    assert math.isnan(event_time(struct.pack("<3d", 1.0, math.nan, 0.0)))


@given(RANKS)
def test_a_rank_bitmap_round_trips_and_is_always_64_bytes(ranks: frozenset[int]) -> None:
    bits = sum(1 << rank for rank in ranks)

    bitmap = rank_bitmap(bits)

    assert len(bitmap) == RANK_BITMAP_BYTES
    assert rank_bits(bitmap) == bits
    assert rank_bits(bitmap).bit_count() == len(ranks)


def test_rank_bitmap_is_little_endian_and_an_empty_column_is_no_ranks() -> None:
    assert rank_bitmap(0b101)[:2] == b"\x05\x00"
    assert rank_bitmap(1 << 511)[-1] == 0x80
    assert rank_bits(None) == 0
    assert rank_bits(b"") == 0


def _run_row(ranks: bytes | None, hosts: str | None) -> tuple[object, ...]:
    return ("run-a", 1.0, 5.0, 42, 8, ranks, None, '{"lr":1}', '{"warning":1}', 4.0, 6.0, "{}", "slow", hosts)


def test_a_run_row_becomes_its_record_counting_the_ranks_and_keying_hosts_by_rank() -> None:
    row = _run_row(rank_bitmap(0b1011), '{"0":"node-a","3":"node-b"}')

    assert run_record(row) == RunRecord(
        run_id="run-a",
        created=1.0,
        last_event=5.0,
        last_step=42,
        world_size=8,
        ranks_reporting=3,
        finished=None,
        config='{"lr":1}',
        findings='{"warning":1}',
        findings_at=4.0,
        received=6.0,
        watch="{}",
        headline="slow",
        hosts={0: "node-a", 3: "node-b"},
    )


def test_a_run_row_without_ranks_or_hosts_has_none_of_either() -> None:
    record = run_record(_run_row(None, None))

    assert record.ranks_reporting is None
    assert record.hosts is None


@given(
    st.dictionaries(st.integers(0, 511), KEY, max_size=6),
    st.dictionaries(st.integers(0, 511), KEY, min_size=1, max_size=6),
)
def test_hosts_merged_keep_the_old_ranks_and_take_the_new_ones(
    kept: dict[int, str], new: dict[int, str]
) -> None:
    text = merged_hosts(json.dumps({str(r): h for r, h in kept.items()}), new)

    assert run_record(_run_row(None, text)).hosts == {**kept, **new}


def test_hosts_merged_into_no_column_are_the_new_ones() -> None:
    assert json.loads(merged_hosts(None, {2: "n"})) == {"2": "n"}


def test_a_token_row_becomes_its_record_with_revoked_as_a_bool() -> None:
    record = token_record(("abcd1234", "proj", 12.5, 1, "ci"))

    assert record == TokenRecord("abcd1234", "proj", 12.5, True, "ci")
    assert record.revoked is True
    assert token_record(("t", "p", 0.0, 0, "")).revoked is False


@given(st.lists(st.builds(Webhook, st.text(max_size=20), st.sampled_from(["info", "warning", "critical"]))))
def test_webhooks_round_trip_through_their_column(webhooks: list[Webhook]) -> None:
    assert webhooks_from_text(webhooks_text(webhooks)) == webhooks


def test_webhooks_are_kept_as_compact_json() -> None:
    text = webhooks_text([Webhook("https://h/x", "critical")])

    assert text == '[{"url":"https://h/x","min_severity":"critical"}]'


PAYLOADS = st.dictionaries(
    st.text(max_size=5), st.none() | st.booleans() | st.integers() | st.text(max_size=5), max_size=4
)


@given(st.text(max_size=10), st.text(max_size=10), PAYLOADS, st.floats(0, 1e10), st.integers(0, 50))
def test_a_queued_delivery_comes_back_from_its_outbox_row(
    delivery_id: str, project: str, payload: dict[str, object], at: float, attempts: int
) -> None:
    delivery = Delivery(delivery_id, project, "https://h/x", payload)

    row = outbox_row(delivery, at)
    # The outbox is read back as id, project, url, payload, created, attempts (next_at is not read).
    back = pending_delivery((*row[:5], attempts))

    assert back == PendingDelivery(delivery, at, attempts)
    assert row[5] == at  # due at once


def test_an_outbox_row_carries_the_payload_as_compact_json() -> None:
    row = outbox_row(Delivery("d1", "proj", "https://h/x", {"a": [1, 2]}), 7.0)

    assert row == ("d1", "proj", "https://h/x", '{"a":[1,2]}', 7.0, 7.0)


def _ranks(bitmap: bytes | None) -> set[int]:
    bits = rank_bits(bitmap)
    return {rank for rank in range(RANK_BITMAP_BYTES * 8) if bits >> rank & 1}


def test_the_first_activity_of_a_run_sets_its_times_step_ranks_and_world() -> None:
    created, last_event, last_step, ranks, world = noted_activity(
        (None, None, None, None, None), RunActivity(5.0, 3, frozenset({0, 511}), 512)
    )

    assert (created, last_event, last_step, world) == (5.0, 5.0, 3, 512)
    assert _ranks(ranks) == {0, 511}


def test_a_newer_step_replaces_the_ranks_and_the_same_step_adds_to_them() -> None:
    row = (1.0, 9.0, 3, rank_bitmap(0b11), 2)

    newer = noted_activity(row, RunActivity(7.0, 4, frozenset({2}), 4))
    same = noted_activity(row, RunActivity(7.0, 3, frozenset({2}), 4))

    assert newer[:3] == (1.0, 9.0, 4)  # created kept; last_event never moves back
    assert (_ranks(newer[3]), newer[4]) == ({2}, 4)
    assert (_ranks(same[3]), same[4]) == ({0, 1, 2}, 4)


def test_an_older_step_or_scalars_change_only_the_time() -> None:
    row = (1.0, 9.0, 3, rank_bitmap(0b1), 2)

    older = noted_activity(row, RunActivity(12.0, 2, frozenset({1}), 2))
    scalars = noted_activity((1.0, 9.0, None, None, None), RunActivity(12.0))

    assert older[:3] == (1.0, 12.0, 3)
    assert (_ranks(older[3]), older[4]) == ({0}, 2)
    assert scalars == (1.0, 12.0, None, None, None)
