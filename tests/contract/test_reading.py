"""Raw reads (contract 9, ``shared.reading.raw``) through the port on both adapters: SQLite, and the
DynamoDB adapter on moto. Pages of any size give every stored event once, ordered by (step, rank),
values bit for bit; a step wider than the page (512 ranks) is not a trap; filters and the window hold;
the memory a page takes does not grow with the run."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest

from instantml import limits
from shared.errors import InvalidInput, NotFound
from shared.ingest.bodies import validate_body
from shared.ingest.parse import to_event
from shared.reading import raw
from shared.store.port import MetricsStore, RowsWanted

SPECIAL = [math.nan, math.inf, -math.inf, 5e-324, -0.0, 0.1 + 0.2]


def put(store: MetricsStore, steps: range, ranks: int, run: str = "r") -> dict[tuple[int, int], float]:
    events, logged = [], {}
    for step in steps:
        for rank in range(ranks):
            value = SPECIAL[(step + rank) % len(SPECIAL)] if (step + rank) % 5 == 0 else step + rank / 1000
            logged[(step, rank)] = value
            body = {
                "step": step,
                "rank": rank,
                "world_size": ranks,
                "time": 1_764_672_000.0 + step,
                "metrics": {"train/loss": limits.wire_value(value), "other": 1.0},
            }
            events.append(to_event("p", run, validate_body(body), f"{run}-{step}-{rank}", 0.0))
    for start in range(0, len(events), 500):
        assert set(store.put_events(events[start : start + 500])) == {"stored"}
    return logged


def every_page(store: MetricsStore, params: dict[str, str], run: str = "r") -> list[dict[str, Any]]:
    pages, cursor = [], None
    while True:
        query = raw.parse_query({**params, **({"cursor": cursor} if cursor else {})})
        page = raw.read_page(store.read_event_rows, "p", run, query)
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 10_000, "paging does not end"


def bits(value: float | str) -> bytes:
    number = limits.NONFINITE_STRINGS[value] if isinstance(value, str) else value
    return struct.pack("<d", number)


@pytest.mark.parametrize("limit", ["1", "100", "5000"])
def test_pages_give_every_event_once_in_order_bit_for_bit_even_past_a_512_rank_step(
    store: MetricsStore, limit: str
) -> None:
    logged = put(store, range(2), 512) | put(store, range(2, 12), 4)
    pages = every_page(store, {"limit": limit, "keys": "train/loss"})
    got = [
        (e["step"], e["rank"], e["values"][p["keys"].index("train/loss")]) for p in pages for e in p["events"]
    ]
    assert [(s, r) for s, r, _ in got] == sorted(logged)
    assert all(bits(v) == bits(logged[(s, r)]) for s, r, v in got)
    assert all(p["keys"] == ["train/loss"] for p in pages if p["events"])


def test_filters_and_the_window_hold(store: MetricsStore) -> None:
    logged = put(store, range(50), 8)
    pages = every_page(store, {"ranks": "1,5-6", "step_min": "10", "step_max": "19", "limit": "7"})
    got = [(e["step"], e["rank"]) for p in pages for e in p["events"]]
    assert got == sorted((s, r) for (s, r) in logged if 10 <= s <= 19 and r in (1, 5, 6))
    assert {k for p in pages for k in p["keys"]} == {"train/loss", "other"}


def test_a_run_without_events_is_not_found_and_bad_queries_name_their_field(store: MetricsStore) -> None:
    with pytest.raises(NotFound):
        raw.read_page(store.read_event_rows, "p", "nothing-here", raw.parse_query({}))
    with pytest.raises(InvalidInput) as bad:
        raw.parse_query({"ranks": "2-1", "limit": "0", "cursor": "%%%", "step_min": "9", "step_max": "3"})
    assert {d.field for d in bad.value.details} == {"ranks", "limit", "cursor", "step_min"}


def test_a_page_is_bounded_in_values_whatever_the_limit(store: MetricsStore, monkeypatch: Any) -> None:
    monkeypatch.setattr(raw, "MAX_PAGE_VALUES", 50)
    logged = put(store, range(12), 8)
    pages = every_page(store, {"limit": "5000"})
    assert all(sum(v is not None for e in p["events"] for v in e["values"]) <= 50 for p in pages)
    assert len([e for p in pages for e in p["events"]]) == len(logged)


def test_rows_go_on_from_a_position_in_step_rank_id_order_within_their_cap(store: MetricsStore) -> None:
    put(store, range(6), 8)
    seen: list[tuple[int, int, str]] = []
    after = None
    while True:
        rows = store.read_event_rows(RowsWanted("p", "r", 1, 4, after, frozenset({2, 7}), 3))
        assert len(rows.event_id) <= 3 or len(set(rows.step)) == 1  # a whole wide step at most beyond
        seen += list(zip(rows.step, rows.rank, rows.event_id, strict=True))
        if rows.resume is None:
            break
        assert not seen or rows.resume >= seen[-1]
        after = rows.resume
    assert seen == sorted((s, r, f"r-{s}-{r}") for s in range(1, 5) for r in (2, 7))
    past_step = store.read_event_rows(
        RowsWanted("p", "r", after=(3, limits.MAX_WORLD_SIZE, ""), max_items=100)
    )
    assert min(past_step.step) == 4 and len(past_step.event_id) == 16 and past_step.resume is None
    assert store.read_event_rows(RowsWanted("p", "r", ranks=frozenset(), max_items=10)).event_id == []
