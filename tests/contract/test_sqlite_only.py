"""What only the SQLite adapter promises: a database that outlives its process, the change feed that
stands in for DynamoDB's stream, a busy database answered as throttling, and a failed batch that
leaves no trace."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.errors import EventIdReused, StoreThrottled, StoreUnavailable
from shared.events import RankEvent
from shared.ingest.bodies import validate_body
from shared.ingest.parse import to_event
from shared.store import ROLLUP_FEED
from shared.store.sqlite import SqliteStore, SqliteTokenStore
from shared.store.sqlite import database as sqlite_database
from shared.summary.query import SummaryQuery
from shared.summary.reads import distributed_summary
from shared.summary.rolling import SETTLE_STEPS, roll_up
from shared.tokens import token_hash

PROJECT = "proj"
NOW = 1_712_345_678.25


def _event(step: int, rank: int = 0, run: str = "run-a", value: float | None = None) -> RankEvent:
    body = {
        "step": step,
        "rank": rank,
        "world_size": 2,
        "metrics": {"train/loss": 1.0 + step / 100 + rank if value is None else value},
        "time": 10.0 + step,
    }
    return to_event(PROJECT, run, validate_body(body), f"{run}-s{step}-r{rank}", NOW)


def _ids(store: SqliteStore, run: str = "run-a") -> list[str]:
    return sorted(e.event_id for e in store.read_events(PROJECT, run).events)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "instantml.db"


# Durability across a restart


def test_given_events_and_rollups_when_the_database_is_reopened_then_all_is_there_and_replays_are_duplicates(
    path: Path,
) -> None:
    events = [_event(step, rank) for step in range(250) for rank in range(2)]
    first = SqliteStore(path)
    assert first.put_events(events) == ["stored"] * 500
    assert roll_up(first, PROJECT, "run-a", set(range(250))).through == 249 - SETTLE_STEPS
    first.db.close()

    second = SqliteStore(path)

    assert _ids(second) == sorted(e.event_id for e in events)
    assert second.next_step(PROJECT, "run-a", 101) == 101
    assert [h.block for h in second.read_blocks(PROJECT, "run-a", 100, 0, 10)] == [0, 1, 2]
    assert second.rollup_progress(PROJECT, "run-a").step == 249 - SETTLE_STEPS
    assert second.put_events(events[:10]) == ["duplicate"] * 10
    [reused] = second.put_events([_event(0, 0, value=-1.0)])
    assert isinstance(reused, EventIdReused)
    # New runs after the restart get their own number: the old run's events stay its own.
    assert second.put_events([_event(0, 0, run="run-b")]) == ["stored"]
    assert _ids(second, "run-b") == ["run-b-s0-r0"]
    assert len(_ids(second)) == 500


def test_given_two_stores_on_one_database_when_both_write_then_each_sees_the_others_events(
    path: Path,
) -> None:
    # The local stack's worker processes each open the database: runs made by one are the other's.
    one, other = SqliteStore(path), SqliteStore(path)
    assert one.put_events([_event(0, run="run-a")]) == ["stored"]
    assert other.put_events([_event(0, run="run-b")]) == ["stored"]
    assert other.put_events([_event(1, run="run-a")]) == ["stored"]
    assert one.put_events([_event(1, run="run-b")]) == ["stored"]

    for store in (one, other):
        assert _ids(store, "run-a") == ["run-a-s0-r0", "run-a-s1-r0"]
        assert _ids(store, "run-b") == ["run-b-s0-r0", "run-b-s1-r0"]
        assert store.put_events([_event(0, run="run-a"), _event(0, run="run-b")]) == ["duplicate"] * 2


# The change feed


def test_given_new_duplicate_and_reused_events_then_the_change_feed_names_each_new_event_once(
    path: Path,
) -> None:
    store = SqliteStore(path)
    assert store.read_changes(0, 100) == ([], 0)

    store.put_events([_event(5), _event(3), _event(5, rank=1)])
    store.put_events([_event(5), _event(3, value=-1.0), _event(7, run="run-b"), _event(1)])
    store.put_events([_event(3)])  # only a replay

    # Each step touched is one change, in the order of its first new event (run-a's step 5 had two).
    changes, position = store.read_changes(0, 100)
    assert changes == [
        (PROJECT, "run-a", 5),
        (PROJECT, "run-a", 3),
        (PROJECT, "run-b", 7),
        (PROJECT, "run-a", 1),
    ]
    assert store.read_changes(position, 100) == ([], position)

    # Read in pages of 2 events, the feed gives the steps of each page's events: the same steps, in
    # the same order of first events (a step whose events span two pages is in both).
    paged, at = [], 0
    while True:
        page, at_next = store.read_changes(at, 2)
        if not page:
            assert at_next == at
            break
        assert 1 <= len(page) <= 2
        assert at_next > at
        paged += page
        at = at_next
    assert paged == [*changes[:2], (PROJECT, "run-a", 5), *changes[2:]]
    assert list(dict.fromkeys(paged)) == changes
    assert at == position

    # Only events are changes: rollups and their progress are not.
    store.advance_rollups(PROJECT, "run-a", 3, b"")
    assert store.read_changes(position, 100) == ([], position)


def test_given_saved_feed_positions_then_they_survive_a_reopen_and_never_move_back(path: Path) -> None:
    store = SqliteStore(path)
    assert store.feed_position("rollups") == 0
    store.put_events([_event(step) for step in range(6)])
    _, middle = store.read_changes(0, 3)
    _, end = store.read_changes(middle, 100)
    assert 0 < middle < end

    store.save_feed_position("rollups", middle)
    assert store.feed_position("rollups") == middle
    store.save_feed_position("rollups", end)
    store.save_feed_position("rollups", middle)  # a slower reader finishing late
    assert store.feed_position("rollups") == end
    store.save_feed_position("other-reader", middle)
    store.db.close()

    reopened = SqliteStore(path)
    assert reopened.feed_position("rollups") == end
    assert reopened.feed_position("other-reader") == middle
    assert reopened.feed_position("never-saved") == 0
    reopened.save_feed_position("rollups", 0)
    assert reopened.feed_position("rollups") == end
    assert reopened.read_changes(end, 100) == ([], end)
    reopened.put_events([_event(6)])
    assert reopened.read_changes(end, 100)[0] == [(PROJECT, "run-a", 6)]


def test_given_a_rank_uploading_after_its_steps_were_rolled_up_then_the_summary_counts_it_at_once(
    path: Path,
) -> None:
    """`instantml sync` sends one rank's spool after another's: the second rank's events land at steps the
    rollup worker has rolled up already. Until the worker has read them (seconds under load), the summary
    reads those steps event by event, so no reader sees the rank missing there."""
    store = SqliteStore(path)
    steps = 40
    store.put_events([_event(step, rank=0) for step in range(steps)])
    changes, position = store.read_changes(0, 10_000)  # as the rollup worker does
    mark = roll_up(store, PROJECT, "run-a", {s for _, _, s in changes}).through
    store.save_feed_position(ROLLUP_FEED, position)
    assert mark == steps - 1 - SETTLE_STEPS
    assert store.late_steps(PROJECT, "run-a", 0, mark, 100) == []

    store.put_events([_event(step, rank=1) for step in range(steps)])  # rank 1's spool, late

    assert store.late_steps(PROJECT, "run-a", 0, mark, 100) == list(range(mark + 1))
    assert store.late_steps(PROJECT, "run-a", 5, 9, 3) == [5, 6, 7]
    for query in (SummaryQuery(), SummaryQuery(step_min=3, step_max=17), SummaryQuery(max_steps=4)):
        document = distributed_summary(store, PROJECT, "run-a", query)
        assert document is not None
        assert document["resolution"]["late_steps_read"] > 0, query
        assert document["coverage"]["reported"] == [2] * len(document["steps"]), query
        assert document["ranks"] == [0, 1]
        assert not [f for f in document["findings"] if f["kind"] == "stopped_reporting"], query
    late_read = distributed_summary(store, PROJECT, "run-a", SummaryQuery())

    # The worker reads rank 1's events: the blocks hold them, and the same numbers come from the blocks.
    changes, position = store.read_changes(position, 10_000)
    roll_up(store, PROJECT, "run-a", {s for _, _, s in changes})
    store.save_feed_position(ROLLUP_FEED, position)
    assert store.late_steps(PROJECT, "run-a", 0, mark, 100) == []
    rolled = distributed_summary(store, PROJECT, "run-a", SummaryQuery())
    assert rolled is not None and late_read is not None
    assert rolled["resolution"]["late_steps_read"] == 0
    assert rolled["reducers"] == late_read["reducers"]
    assert rolled["coverage"] == late_read["coverage"]


# A busy database is throttling (429), not a failure


@pytest.fixture
def short_busy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers wait 50 ms for the lock instead of 10 s (read when a store opens its connection)."""
    monkeypatch.setattr(sqlite_database, "BUSY_TIMEOUT_S", 0.05)


@pytest.fixture
def held_write_lock(path: Path, short_busy_timeout: None) -> Iterator[sqlite3.Connection]:
    """Another connection (another process, as far as SQLite knows) in a write transaction."""
    SqliteStore(path)  # the database and its tables exist
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO feed_cursors (name, position) VALUES ('held', 1)")
    yield other
    other.close()


def test_given_another_writer_holds_the_lock_when_a_batch_comes_then_it_is_throttled_and_its_retry_stores_it(
    path: Path, held_write_lock: sqlite3.Connection
) -> None:
    store = SqliteStore(path)
    events = [_event(step) for step in range(5)]

    with pytest.raises(StoreThrottled) as caught:
        store.put_events(events)
    assert caught.value.code == "rate_limited"
    assert caught.value.retry_after >= 1
    writes: list[Callable[[], object]] = [
        lambda: store.advance_rollups(PROJECT, "run-a", 1, b""),
        lambda: store.save_feed_position("rollups", 1),
        lambda: store.write_blocks(PROJECT, "run-a", []),
    ]
    for write in writes:
        with pytest.raises(StoreThrottled):
            write()
    # WAL: reads go on while the other writer holds the lock.
    assert store.read_events(PROJECT, "run-a").events == []
    assert store.read_changes(0, 10) == ([], 0)

    held_write_lock.execute("COMMIT")

    assert store.put_events(events) == ["stored"] * 5
    assert _ids(store) == sorted(e.event_id for e in events)
    assert len(store.read_changes(0, 10)[0]) == 5


# Tokens: looked up by their hash, on the authorizer's own connection


def test_given_tokens_when_looked_up_by_hash_then_each_is_found_as_it_stands_and_a_failure_is_the_ports(
    path: Path,
) -> None:
    tokens = SqliteTokenStore(path)
    token, record = tokens.create("proj", "ci")
    other, _ = tokens.create("other")

    assert tokens.lookup_hash(token_hash(token)) == record
    assert tokens.lookup_hash(token) is None  # the token itself is not a key: only its hash is
    assert tokens.revoke(record.token_id)
    found = tokens.lookup_hash(token_hash(token))
    assert found is not None
    assert found.revoked  # the next lookup sees the revocation
    assert tokens.lookup_hash(token_hash(other)) is not None

    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE tokens")
    with pytest.raises(StoreUnavailable, match="failed reading tokens"):
        tokens.lookup_hash(token_hash(other))


# A batch that fails part-way


def test_given_a_batch_that_failed_part_way_when_retried_then_its_run_keeps_its_events_and_no_other_sees_them(
    path: Path,
) -> None:
    """A write transaction that rolls back must take back everything it made, the run's number too.

    The disk fills up part-way through the first batch of a run (``max_page_count`` on the store's own
    connection plays the full disk): the batch is answered 503 and the client retries it once there is
    room, as the port says it may. Then another run starts.
    """
    store = SqliteStore(path)
    conn = store.db.connection()  # this thread's connection: the store's own
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + 2}")
    batch = [_event(step, rank) for step in range(500) for rank in range(2)]

    with pytest.raises(StoreUnavailable):
        store.put_events(batch)
    assert store.read_events(PROJECT, "run-a").events == []
    assert store.read_changes(0, 10) == ([], 0)

    conn.execute("PRAGMA max_page_count = 1073741823")  # room again
    assert store.put_events(batch) == ["stored"] * 1000
    assert store.put_events([_event(0, run="run-b")]) == ["stored"]

    assert _ids(store, "run-b") == ["run-b-s0-r0"]
    assert len(_ids(store)) == 1000
    assert {run for _, run, _ in store.read_changes(0, 2000)[0]} == {"run-a", "run-b"}
    store.db.close()
    reopened = SqliteStore(path)
    assert len(_ids(reopened)) == 1000
    assert _ids(reopened, "run-b") == ["run-b-s0-r0"]


def test_given_a_database_with_the_single_level_rollups_when_opened_then_they_are_rebuilt_from_the_feed(
    path: Path,
) -> None:
    store = SqliteStore(path)
    store.put_events([_event(step) for step in range(30)])
    store.save_feed_position("rollups", 30)
    store.db.close()
    old = sqlite3.connect(path)  # what a database from before the levels holds
    old.executescript(
        "CREATE TABLE rollup_blocks (run INTEGER, block INTEGER, n INTEGER, h BLOB, keys TEXT);"
        "CREATE TABLE rollup_sums (run INTEGER, key TEXT, block INTEGER, n INTEGER, v BLOB);"
        "CREATE TABLE rollup_progress (run INTEGER PRIMARY KEY, through INTEGER NOT NULL);"
        "INSERT INTO rollup_progress VALUES (1, 0);"
    )
    old.close()

    reopened = SqliteStore(path)
    tables = {row[0] for row in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")}
    assert not tables & {"rollup_blocks", "rollup_sums", "rollup_progress"}
    assert reopened.feed_position("rollups") == 0  # the rollup worker reads every event again
    assert len(reopened.read_changes(0, 100)[0]) == 30
    assert len(_ids(reopened)) == 30
