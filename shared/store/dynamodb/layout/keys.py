"""Where each item lives: the keys of the metrics table's events, scalars and rolled blocks, and of the runs
table's items (a run's own, its config's, its rank groups'), as ``shared.store.dynamodb``'s docstring lays
them out. Pure: strings in, strings out, no client."""

from __future__ import annotations

import re
import zlib
from typing import Any

SHARDS = 16
PARTITION_KEY = "pk"
SORT_KEY = "sk"
STEP_DIGITS = 16  # 2**53 - 1 has 16 digits
#: The largest step (or block) a sort key holds.
LAST_STEP = 10**STEP_DIGITS - 1

#: The tables' TTL attribute (template.yaml: TimeToLiveSpecification): epoch seconds after which DynamoDB
#: deletes the item (within a few days). Written only when the deployment sets a retention.
EXPIRES = "expires"
#: Days what the ingest writes is kept (template.yaml: RetentionDays); 0 or unset keeps it.
RETENTION_ENV = "RETENTION_DAYS"

ROLLUP_PREFIX = "@rollup#"
SCALARS_PREFIX = "@scalars#"
PROGRESS_SK = "~rolled"  # sorts after every block's key ("~progress", the single level's, is left alone)


def partition_key(project: str, run_id: str, shard: int) -> str:
    return f"{project}#{run_id}#{shard:02x}"


def sort_key(step: int, event_id: str) -> str:
    return f"{step:0{STEP_DIGITS}d}#{event_id}"


def step_of_sort_key(key: str) -> int:
    return int(key[:STEP_DIGITS])


def event_id_of_sort_key(key: str) -> str:
    return key[STEP_DIGITS + 1 :]


def step_window(step_min: int, step_max: int | None) -> tuple[str, str]:
    """The sort-key range of a step window."""
    high = LAST_STEP if step_max is None else step_max
    return f"{step_min:0{STEP_DIGITS}d}#", f"{high:0{STEP_DIGITS}d}#\U0010ffff"


def scalar_partition(project: str, run_id: str) -> str:
    return f"{SCALARS_PREFIX}{project}#{run_id}"


def event_of_key(pk: str, sk: str) -> tuple[str, str, int] | None:
    """(project, run_id, step) of an event item's keys; None for any other item (``@`` partitions)."""
    parts = pk.split("#")
    if pk.startswith("@") or len(parts) != 3 or not sk[:STEP_DIGITS].isdigit():
        return None
    return parts[0], parts[1], step_of_sort_key(sk)


def block_partition(project: str, run_id: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}"


def key_partition(project: str, run_id: str, key: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}#{key}"


def block_sort_key(size: int, block: int) -> str:
    """A rolled block's sort key: its level, then its number, so that one level's blocks are a range."""
    return f"{size:05d}:{block:0{STEP_DIGITS}d}"


def block_of_sort_key(key: str) -> int:
    return int(key.partition(":")[2])


def block_window(size: int, first: int, last: int) -> tuple[str, str]:
    """The sort-key range of one level's blocks ``first..last``."""
    return block_sort_key(size, first), block_sort_key(size, min(last, LAST_STEP))


# The runs table (keys ``project`` and ``run_id``).
#
# A run's items live in a partition of their own, ``{project}#{run_id}`` (``run_partition``; no name holds
# ``#``): the hash key called ``project`` holds the run's partition, not the project. With the project
# alone as the partition, every run of a project wrote its rank groups and its own item onto one key,
# about 53 write units/s per live 512-rank run, so about 17 such runs at once reached a partition's
# 1,000 (issue 41). Runs recorded before this layout sit in the project's partition (``project``):
# ``LEGACY_RUNS_INDEX`` lists them and a run that is not found in its own partition is read there.

#: The runs table's index of a project's runs by ``last_event``, newest first (template.yaml): its hash
#: key is ``listing_shard``, one of ``LISTING_SHARDS`` values a project, so live runs' writes of their
#: own items spread over that many index partitions, and a listing is that many parallel queries.
RUNS_INDEX = "by_project"
#: The index of the earlier layout (hash key ``project`` = the project): it lists the runs recorded
#: before ``run_partition``; it holds a newer run's item too, alone under that run's partition.
LEGACY_RUNS_INDEX = "by_activity"
#: Values of ``listing_shard`` a project: a live run's own item changes about once a second (the note's
#: condition, ``RunsMixin.note_activity``), and each change is an index write, so 100 live runs in one
#: project give each shard a few tens of write units/s (benchmarks/aws_model.py), where one takes 1,000.
LISTING_SHARDS = 8
#: The runs table's index of every project's runs by ``received`` (template.yaml): the watch's list.
WATCH_INDEX = "by_received"
#: Values of ``watch_shard`` (``w0``..): the index's partitions. A live run's own item changes about
#: once a second per ingest instance, and ``received`` (the index's sort key) with it, so one partition
#: would take every run's index writes; 4 spread them (a partition takes 1,000 writes/s) and a round
#: still costs only 4 queries.
WATCH_SHARDS = 4
#: Ranks per rank group: a run's step part is kept on its rank groups' items (``{run_id}#s00`` ..
#: ``#s15`` at 512 ranks, ``#s-`` for a step noted without ranks), each written only by its own ranks'
#: notes, so that 512 ranks' batches spread over 16 items of under 1 KB that no index holds.
RANKS_PER_GROUP = 32
#: What follows a run id in the ids of its other items: no run id holds ``#``, and ``#`` sorts before
#: every character one may hold, so a run's items are the range ``[run_id, run_id#\U0010ffff]``.
CONFIG_ITEM, GROUP_ITEM = "#config", "#s"
#: The last id of a run's items.
RUN_ITEMS_END = "#\U0010ffff"
HOST = re.compile(r"h\d+")  # a rank's host on its group's item
#: A run's process items (contract 8: one per rank, overwritten) follow its other items: ``$`` sorts after
#: ``#`` and before every character a run id may hold, so they are outside the range ``get_run`` reads and
#: inside no other run's, and a run's processes are the range ``[run_id$p, run_id$p\U0010ffff]``.
PROCESS_ITEM = "$p"


def process_item(run_id: str, rank: int) -> str:
    return f"{run_id}{PROCESS_ITEM}{rank:03d}"


def process_items(run_id: str) -> tuple[str, str]:
    return run_id + PROCESS_ITEM, run_id + PROCESS_ITEM + "\U0010ffff"


def run_partition(project: str, run_id: str) -> str:
    """The runs table's partition of a run's items (its own, config, rank groups, processes)."""
    return f"{project}#{run_id}"


def project_of_partition(partition: str, run_id: str) -> str:
    """The project of a run item's partition: ``run_partition``'s, or the project itself (the earlier
    layout's)."""
    suffix = "#" + run_id
    return partition[: -len(suffix)] if partition.endswith(suffix) else partition


def run_of_item(item_id: str) -> str:
    """The run id of an item id of the runs table (``run_id``, ``{run_id}#config``, ``{run_id}$p003``)."""
    return _ITEM_SUFFIX.split(item_id, maxsplit=1)[0]


_ITEM_SUFFIX = re.compile(r"[#$]")


def run_key(project: str, item_id: str, legacy: bool = False) -> dict[str, Any]:
    """The key of one of a run's items: in the run's partition, or (``legacy``) in the project's."""
    partition = project if legacy else run_partition(project, run_of_item(item_id))
    return {"project": {"S": partition}, "run_id": {"S": item_id}}


def listing_shard(project: str, run_id: str) -> str:
    """A run's partition of ``RUNS_INDEX``: the project and a stable hash of the run id."""
    return f"{project}@{zlib.crc32(run_id.encode('utf-8', 'surrogatepass')) % LISTING_SHARDS}"


def listing_shards(project: str) -> list[str]:
    return [f"{project}@{n}" for n in range(LISTING_SHARDS)]


def config_item(run_id: str) -> str:
    return run_id + CONFIG_ITEM


def group_item(run_id: str, group: str) -> str:
    return run_id + GROUP_ITEM + group


def rank_groups(ranks: frozenset[int]) -> list[tuple[str, frozenset[int]]]:
    """The activity's ranks by rank group; a step noted without ranks goes to the group ``-``."""
    if not ranks:
        return [("-", frozenset())]
    groups: dict[str, set[int]] = {}
    for rank in ranks:
        groups.setdefault(f"{rank // RANKS_PER_GROUP:02d}", set()).add(rank)
    return [(group, frozenset(members)) for group, members in sorted(groups.items())]


def rank_attributes(rank: int | None) -> tuple[str, str]:
    """A rank's attributes on its group's item: its last step and its world size there (``n``: a step
    noted without ranks)."""
    suffix = "n" if rank is None else str(rank)
    return f"s{suffix}", f"w{suffix}"


def watch_shards() -> list[str]:
    return [f"w{n}" for n in range(WATCH_SHARDS)]


def watch_shard(project: str, run_id: str) -> str:
    """A run's shard of ``WATCH_INDEX``: a stable hash of its keys (never Python's ``hash``, which
    changes from one process to the next)."""
    digest = zlib.crc32(f"{project}#{run_id}".encode("utf-8", "surrogatepass"))
    return f"w{digest % WATCH_SHARDS}"
