"""The expressions the store sends, built without a client: a key range of the metrics table, the updates
of a run's items (with their attribute aliases) and the query that lists a project's runs. Pure."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from shared.store.dynamodb.layout.codecs import number
from shared.store.dynamodb.layout.keys import (
    EXPIRES,
    LEGACY_RUNS_INDEX,
    PARTITION_KEY,
    RUNS_INDEX,
    SORT_KEY,
    rank_attributes,
)
from shared.store.port import RunRecord

#: Set in every update of a run's activity (``note_activity``, ``update_run``): the server's clock and the
#: run's watch shard, which together put the run in ``WATCH_INDEX``, and its listing shard (``RUNS_INDEX``).
RECEIVED_SET = "#rcv = :now, #wsh = :wsh, #lsh = :lsh"
#: Every attribute of a run's item, by the alias the expressions use (aliases avoid DynamoDB's reserved
#: words; a request names exactly the attributes its expressions use, which is what IAM checks).
RUN_ATTRIBUTES = {
    "#p": "project",
    "#r": "run_id",
    "#c": "created",
    "#le": "last_event",
    "#ls": "last_step",
    "#ws": "world_size",
    "#rk": "ranks",
    "#fin": "finished",
    "#cfg": "config",
    "#f": "findings",
    "#fat": "findings_at",
    "#rcv": "received",
    "#wsh": "watch_shard",
    "#lsh": "listing_shard",
    "#w": "watch",
    "#hl": "headline",
    "#doc": "doc",  # a process item's document (contract 8)
    "#v": "version",  # ... and its version: each write is conditional on the one it read
    "#exp": EXPIRES,
}
_ALIAS = re.compile(r"#\w+")
_RANK_ALIAS = re.compile(r"#([sw](?:\d+|n)|h\d+)")
#: The statuses a listing keeps when it names none.
RUN_STATUSES = frozenset(("live", "idle", "finished"))


def names(*expressions: str) -> dict[str, str]:
    """The ``ExpressionAttributeNames`` of exactly the aliases used (DynamoDB refuses unused ones): a run
    item's attributes, and a rank group's ``#s{rank}``/``#w{rank}`` (``#sn``/``#wn``) and ``#h{rank}``
    for themselves."""
    return {
        alias: RUN_ATTRIBUTES.get(alias) or _rank_attribute(alias)
        for e in expressions
        for alias in _ALIAS.findall(e)
    }


def _rank_attribute(alias: str) -> str:
    found = _RANK_ALIAS.fullmatch(alias)
    if found is None:
        raise KeyError(alias)
    return found.group(1)


def key_range_query(table: str, pk: str, low: str, high: str) -> dict[str, Any]:
    """A query of the metrics table's partition ``pk`` for the sort keys ``low..high``."""
    return {
        "TableName": table,
        "KeyConditionExpression": "#pk = :pk AND #sk BETWEEN :low AND :high",
        "ExpressionAttributeNames": {"#pk": PARTITION_KEY, "#sk": SORT_KEY},
        "ExpressionAttributeValues": {":pk": {"S": pk}, ":low": {"S": low}, ":high": {"S": high}},
    }


def with_expires(update: str, values: dict[str, Any], expires: int | None) -> str:
    """``update`` with ``expires`` set too when the deployment keeps a retention (``expires`` not None;
    its value is added to ``values``)."""
    if expires is None:
        return update
    values[":exp"] = {"N": str(expires)}
    if "SET " in update:
        return update.replace("SET ", "SET #exp = :exp, ", 1)
    return f"{update} SET #exp = :exp"


def rank_steps_update(
    members: list[int | None], step: int, world_size: int | None
) -> tuple[str, dict[str, Any], str]:
    """Set each member's step (and world size, or remove it), if each one's step grows: the update, its
    values and its condition."""
    sets, removes, conditions = [], [], []
    values: dict[str, Any] = {":s": number(step)}
    if world_size is not None:
        values[":ws"] = number(world_size)
    for member in members:
        s_name, w_name = rank_attributes(member)
        sets.append(f"#{s_name} = :s")
        if world_size is None:
            removes.append(f"#{w_name}")
        else:
            sets.append(f"#{w_name} = :ws")
        conditions.append(f"(attribute_not_exists(#{s_name}) OR #{s_name} < :s)")
    update = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
    return update, values, " AND ".join(conditions)


# Listing a project's runs (``list_runs``): a query of ``RUNS_INDEX``.


class ActivityBounds(NamedTuple):
    """Bounds on ``last_event``, the index's sort key (None: no such bound)."""

    low: float | None  # last_event >= low
    high: float | None  # last_event <= high
    below: float | None  # last_event < below


def activity_bounds(wanted: frozenset[str], idle_before: float, cursor: float | None) -> ActivityBounds:
    """The bounds of a listing of the statuses ``wanted`` after a cursor at time ``cursor``: the cursor's
    time read again (runs of equal times have no defined order in the index), and, when the one
    unfinished status wanted is ``live`` or ``idle``, ``idle_before`` from below or above."""
    unfinished = wanted - {"finished"}
    only = unfinished if "finished" not in wanted and len(unfinished) == 1 else frozenset()
    high = cursor
    low = idle_before if only == {"live"} else None
    below = idle_before if only == {"idle"} else None
    if high is not None and below is not None:  # keep the stricter upper bound
        high, below = (high, None) if high < below else (None, below)
    return ActivityBounds(low, high, below)


def activity_condition(bounds: ActivityBounds, hash_alias: str = "#lsh") -> str | None:
    """The index's key condition of ``bounds`` (its hash key ``hash_alias`` = ``:p``); None when no time
    falls within them."""
    low, high, below = bounds
    part = f"{hash_alias} = :p"
    if low is not None and high is not None:
        return None if high < low else f"{part} AND #le BETWEEN :low AND :high"
    if low is not None:
        return f"{part} AND #le >= :low"
    if high is not None:
        return f"{part} AND #le <= :high"
    if below is not None:
        return f"{part} AND #le < :below"
    return part


def finished_filter(wanted: frozenset[str]) -> str | None:
    """The filter on ``finished`` when only unfinished or only finished runs are wanted."""
    if "finished" not in wanted:
        return "attribute_not_exists(#fin)"
    if wanted == {"finished"}:
        return "attribute_exists(#fin)"
    return None


def runs_index_query(
    partition: str,
    limit: int,
    wanted: frozenset[str],
    idle_before: float,
    cursor: float | None,
    legacy: bool = False,
) -> dict[str, Any] | None:
    """The query of one partition of ``RUNS_INDEX`` (a listing shard), or with ``legacy`` of
    ``LEGACY_RUNS_INDEX`` (a project), but its ``TableName``, that lists its runs of the statuses
    ``wanted``, newest first, after a cursor at time ``cursor``; None when no run can be listed. It reads
    pages of at least 100 runs: the runs of the last kept time are all read (``list_runs``)."""
    bounds = activity_bounds(wanted, idle_before, cursor)
    key = activity_condition(bounds, "#p" if legacy else "#lsh")
    if key is None:
        return None
    query: dict[str, Any] = {
        "IndexName": LEGACY_RUNS_INDEX if legacy else RUNS_INDEX,
        "KeyConditionExpression": key,
        "ScanIndexForward": False,
        "Limit": max(limit + 1, 100),
    }
    only = finished_filter(wanted)
    if only is not None:
        query["FilterExpression"] = only
    query["ExpressionAttributeNames"] = names(key, only or "")
    query["ExpressionAttributeValues"] = {":p": {"S": partition}} | {
        f":{name}": number(bound) for name, bound in bounds._asdict().items() if bound is not None
    }
    return query


def run_listed(
    record: RunRecord, wanted: frozenset[str], idle_before: float, after: tuple[float, str] | None
) -> bool:
    """Whether a listing keeps ``record``: after the cursor (``after``: its time and run id, newest
    first), and of a status ``wanted`` (the query's bounds and filter narrow the reads only)."""
    if after is not None and (record.last_event, record.run_id) >= after:
        return False
    if record.finished is not None:
        return "finished" in wanted
    return ("idle" if record.last_event < idle_before else "live") in wanted
