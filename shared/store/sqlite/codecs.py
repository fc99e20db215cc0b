"""Rows of the database as the port's values and back: pure functions, no database in sight (so they are
tested on their own, tests/unit/test_sqlite_codecs.py).

The ingest loop (``shared.store.sqlite.events``) packs each event's row inline instead of through a
function here: a call per event is measurable at tens of thousands of events a second.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import asdict
from typing import Any

from shared.store.port import (
    Delivery,
    EventRows,
    PendingDelivery,
    Position,
    RunActivity,
    RunRecord,
    StoredEvent,
    Webhook,
)

#: The ranks at a run's last step, one bit per rank (world sizes are at most 512).
RANK_BITMAP_BYTES = 64

_new_event = functools.partial(tuple.__new__, StoredEvent)


def stored_events(rows: list[tuple[Any, ...]]) -> list[StoredEvent]:
    """Rows with the columns of an event in StoredEvent's order, each made one with no per-field Python."""
    if not rows:
        return []
    ids, steps, ranks, sizes, joined, packed, local = zip(*rows, strict=True)
    # Events with the same keys share one list (the summary maps each distinct list once).
    split = {keys: keys.split("\n") for keys in dict.fromkeys(joined)}
    key_lists = [split[keys] for keys in joined]
    return list(map(_new_event, zip(ids, steps, ranks, sizes, key_lists, packed, local, strict=True)))


def event_rows(rows: list[tuple[Any, ...]], resume: Position | None) -> EventRows:
    """Rows with the columns of an event in StoredEvent's order as columns (``EventRows``)."""
    if not rows:
        return EventRows([], [], [], [], [], [], [], resume)
    ids, steps, ranks, sizes, joined, packed, local = map(list, zip(*rows, strict=True))
    split = {keys: keys.split("\n") for keys in dict.fromkeys(joined)}
    return EventRows(ids, steps, ranks, sizes, local, [split[k] for k in joined], packed, resume)


def event_time(packed: bytes) -> float:
    """The time of an event's packed ``[weight, time, *values]`` (little-endian float64s)."""
    return float(struct.unpack_from("<d", packed, 8)[0])


def rank_bitmap(bits: int) -> bytes:
    """The ranks at a step (bit ``rank`` set for each) as the ``ranks`` column stores them."""
    return bits.to_bytes(RANK_BITMAP_BYTES, "little")


def rank_bits(bitmap: bytes | None) -> int:
    """The ``ranks`` column as bits (none when empty)."""
    return int.from_bytes(bitmap or b"", "little")


def noted_activity(
    row: tuple[Any, ...], activity: RunActivity
) -> tuple[float, float, int | None, bytes | None, int | None]:
    """``created, last_event, last_step, ranks, world_size`` of a run's row once ``activity`` is noted
    on it: the ranks of a newer step replace those of the last one, those of the same step join them."""
    created, last_event, last_step, ranks, world_size = row
    bits = rank_bits(ranks)
    if activity.step is not None:
        new = sum(1 << rank for rank in activity.ranks)
        if last_step is None or activity.step > last_step:
            last_step, bits, world_size = activity.step, new, activity.world_size
        elif activity.step == last_step:
            bits |= new
            world_size = max(world_size or 0, activity.world_size or 0) or None
    return (
        activity.time if created is None else created,
        activity.time if last_event is None else max(last_event, activity.time),
        last_step,
        None if last_step is None else rank_bitmap(bits),
        world_size,
    )


def run_record(row: tuple[Any, ...]) -> RunRecord:
    """A row with the columns of ``shared.store.sqlite.runs.SELECT_RUN``, in its order."""
    run_id, created, last_event, last_step, world_size, ranks, finished, config, findings, findings_at = row[
        :10
    ]
    received, watch, headline, hosts = row[10:]
    return RunRecord(
        run_id=run_id,
        created=created,
        last_event=last_event,
        last_step=last_step,
        world_size=world_size,
        ranks_reporting=None if ranks is None else rank_bits(ranks).bit_count(),
        finished=finished,
        config=config,
        findings=findings,
        findings_at=findings_at,
        received=received,
        watch=watch,
        headline=headline,
        hosts=None if hosts is None else {int(rank): host for rank, host in json.loads(hosts).items()},
    )


def merged_hosts(kept: str | None, hosts: dict[int, str]) -> str:
    """The ``hosts`` column with ``hosts`` merged over the ranks' hosts ``kept`` (the column's text)."""
    return json.dumps({**json.loads(kept or "{}"), **{str(rank): host for rank, host in hosts.items()}})


def webhooks_text(webhooks: list[Webhook]) -> str:
    """A project's webhooks as the ``alert_hooks`` row keeps them (compact JSON)."""
    return json.dumps([asdict(hook) for hook in webhooks], separators=(",", ":"))


def webhooks_from_text(text: str) -> list[Webhook]:
    return [Webhook(**hook) for hook in json.loads(text)]


def outbox_row(delivery: Delivery, at: float) -> tuple[str, str, str, str, float, float]:
    """``id, project, url, payload, created, next_at`` of a delivery queued at ``at``, due at once."""
    d = delivery
    return (d.delivery_id, d.project, d.url, json.dumps(d.payload, separators=(",", ":")), at, at)


def pending_delivery(row: tuple[Any, ...]) -> PendingDelivery:
    """A row of ``id, project, url, payload, created, attempts`` of the outbox."""
    return PendingDelivery(Delivery(row[0], row[1], row[2], json.loads(row[3])), row[4], row[5])
