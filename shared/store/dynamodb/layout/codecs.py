"""Items to and from domain types: an event's item and its size in write units, a stored event, a key
item's sums, a run's items as one ``RunRecord``, the watch's packed state. Pure: no client."""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

from shared.store.dynamodb.layout.keys import (
    EXPIRES,
    GROUP_ITEM,
    HOST,
    PARTITION_KEY,
    SHARDS,
    SORT_KEY,
    config_item,
    event_id_of_sort_key,
    partition_key,
    sort_key,
    step_of_sort_key,
)
from shared.store.port import RunRecord, StoredEvent

if TYPE_CHECKING:
    from shared.events import Event


def number(value: float) -> dict[str, str]:
    return {"N": repr(value)}  # repr: the shortest text that reads back as the same float


def item_of(event: Event, pk: str | None = None, expires: int | None = None) -> dict[str, Any]:
    """The DynamoDB item of one event (the layout of ``shared.store.dynamodb``'s docstring), in its
    shard's partition unless ``pk`` names another (a scalar's); with ``expires`` (epoch seconds) the
    table's TTL deletes it after that time."""
    packed = struct.pack(f"<{2 + len(event.values)}d", event.weight, event.time, *event.values)
    if pk is None:
        pk = partition_key(event.project, event.run_id, event.rank % SHARDS)
    item: dict[str, Any] = {
        PARTITION_KEY: {"S": pk},
        SORT_KEY: {"S": sort_key(event.step, event.event_id)},
        "r": {"N": str(event.rank)},
        "ws": {"N": str(event.world_size)},
        "k": {"S": "\n".join(event.keys)},
        "v": {"B": packed},
        "h": {"B": event.payload_digest},
    }
    if event.local_rank is not None:
        item["lr"] = {"N": str(event.local_rank)}
    if expires is not None:
        item[EXPIRES] = {"N": str(expires)}
    return item


def item_size(item: dict[str, Any]) -> int:
    """DynamoDB's size of an item in bytes: attribute names plus values (numbers approximated)."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        ((kind, data),) = value.items()
        if kind == "S":
            size += len(data.encode())
        elif kind == "B":
            size += len(data)
        else:  # N: about one byte per two significant digits, plus one
            size += 1 + (len(str(data).lstrip("-").replace(".", "")) + 1) // 2
    return size


def write_units(item: dict[str, Any]) -> int:
    """On-demand write units of one put of ``item``: one per started KB."""
    return max(1, -(-item_size(item) // 1024))


#: What a read of events asks of each item: all ``stored_event`` reads.
EVENT_PROJECTION = "#sk, r, ws, lr, k, v"


def stored_event(item: dict[str, Any]) -> StoredEvent:
    """An event item as read (``EVENT_PROJECTION``): its values still packed."""
    sk = item[SORT_KEY]["S"]
    return StoredEvent(
        event_id=event_id_of_sort_key(sk),
        step=step_of_sort_key(sk),
        rank=int(item["r"]["N"]),
        world_size=int(item["ws"]["N"]),
        keys=item["k"]["S"].split("\n"),
        packed=item["v"]["B"],
        local_rank=int(item["lr"]["N"]) if "lr" in item else None,
    )


def block_sums(item: dict[str, Any]) -> bytes:
    """A key item's packed sums: ``vz`` (zlib) as written now, ``v`` (plain) as written before."""
    if "vz" in item:
        return zlib.decompress(item["vz"]["B"])
    return item["v"]["B"]  # type: ignore[no-any-return]


def pack_watch(state: str) -> bytes:
    """The watch's state as stored: zlib-compressed JSON. The run's own item is rewritten about once a
    second while the run is live and DynamoDB bills a write by the whole item's size, so the state's
    size is paid on each of those writes (and each index write); JSON findings compress about tenfold."""
    return zlib.compress(state.encode("utf-8", "surrogatepass"), 6)


def unpack_watch(value: dict[str, Any]) -> str:
    if "S" in value:
        return str(value["S"])
    return zlib.decompress(value["B"]).decode("utf-8", "surrogatepass")


class RankStep(NamedTuple):
    """One rank's last step and its world size there (``rank`` None: a step noted without ranks)."""

    step: int
    rank: int | None
    world_size: int | None


def rank_steps(item: dict[str, Any]) -> list[RankStep]:
    """The rank steps a rank group's item records, or those of a run's item written before the groups
    (``last_step``, ``ranks`` and ``world_size`` of its own)."""
    if "last_step" in item:
        step = int(float(item["last_step"]["N"]))
        size = int(float(item["world_size"]["N"])) if "world_size" in item else None
        ranks = [int(rank) for rank in item.get("ranks", {}).get("NS", [])]
        return [RankStep(step, None, size)] + [RankStep(step, rank, size) for rank in ranks]
    out = []
    for name, value in item.items():
        if name[:1] == "s" and (name[1:].isdigit() or name == "sn"):
            rank = None if name == "sn" else int(name[1:])
            size = item.get("w" + name[1:])
            out.append(RankStep(int(float(value["N"])), rank, int(float(size["N"])) if size else None))
    return out


def run_record(item: dict[str, Any], others: list[dict[str, Any]] | None = None) -> RunRecord:
    """A run's item (or its index entry) as a ``RunRecord``, with the step part merged from its rank
    groups among ``others`` (its items in the runs table) and its config from its config item.

    The last step is the largest of the ranks' (and of steps noted without ranks); the ranks reporting
    are those whose last step it is, their world size the largest there: the same record one item would
    hold, since a rank appears at the run's last step exactly when its own last step is that one. An item
    written before the groups (with ``last_step``, ``ranks`` and ``config`` of its own) counts too."""

    def numeric(name: str) -> float | None:
        return float(item[name]["N"]) if name in item else None

    def text(name: str) -> str | None:
        return item[name]["S"] if name in item else None

    run_id = item["run_id"]["S"]
    config = text("config")
    steps = rank_steps(item)
    hosts: dict[int, str] = {}
    for other in others or []:
        other_id = other["run_id"]["S"]
        if other_id == config_item(run_id) and "config" in other:
            config = other["config"]["S"]
        elif other_id.startswith(run_id + GROUP_ITEM):
            steps += rank_steps(other)
            hosts.update((int(name[1:]), v["S"]) for name, v in other.items() if HOST.fullmatch(name))
    last_step = max((s.step for s in steps), default=None)
    at_last = [s for s in steps if s.step == last_step]
    sizes = [s.world_size for s in at_last if s.world_size is not None]
    last_event = float(item["last_event"]["N"])
    created = numeric("created")
    return RunRecord(
        run_id=run_id,
        created=last_event if created is None else created,
        last_event=last_event,
        last_step=last_step,
        world_size=max(sizes) if sizes else None,
        ranks_reporting=None if last_step is None else len({s.rank for s in at_last if s.rank is not None}),
        finished=numeric("finished"),
        config=config,
        findings=text("findings"),
        findings_at=numeric("findings_at"),
        received=numeric("received"),
        watch=unpack_watch(item["watch"]) if "watch" in item else None,
        headline=text("headline"),
        hosts=hosts or None,
    )
