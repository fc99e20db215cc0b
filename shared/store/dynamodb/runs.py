"""Run records (``RunStore``) in the runs table: activity notes, run updates, findings counts, one run read
back and a project's runs listed newest first."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.store.dynamodb.errors import store_errors
from shared.store.dynamodb.layout.codecs import number, run_record
from shared.store.dynamodb.layout.expressions import (
    RECEIVED_SET,
    RUN_STATUSES,
    names,
    rank_steps_update,
    run_listed,
    runs_index_query,
)
from shared.store.dynamodb.layout.keys import (
    LISTING_SHARDS,
    config_item,
    group_item,
    listing_shard,
    listing_shards,
    process_item,
    process_items,
    rank_attributes,
    rank_groups,
    run_key,
    run_partition,
    watch_shard,
)
from shared.store.dynamodb.run_table import RunTable
from shared.store.port import RunActivity, RunRecord, RunStatus

#: Entries a store remembers of what the runs table holds (recorded times, rank groups seen).
REMEMBERED = 10_000


def remember(memory: dict[Any, Any], key: Any, value: Any) -> None:
    """Remember ``value`` as the newest entry, forgetting the oldest beyond ``REMEMBERED``."""
    memory.pop(key, None)
    memory[key] = value
    if len(memory) > REMEMBERED:
        del memory[next(iter(memory))]


def _activity_order(entry: tuple[RunRecord, dict[str, Any]]) -> tuple[float, str]:
    return entry[0].last_event, entry[0].run_id


#: Reads and conditional writes of a process item before a racing writer is left to win.
PROCESS_WRITE_TRIES = 5


class RunsMixin(RunTable):
    """Run records: each run's own item, its config's and its rank groups'."""

    #: A note whose step part is new may leave the run's time as recorded for up to this long
    #: (``RunStore``): the run's own item, which both indexes hold, is then written about once a second.
    run_time_resolution_s = 1.0

    def _received(self, project: str, run_id: str) -> dict[str, Any]:
        """The values of ``RECEIVED_SET``: the server's clock now and the run's watch and listing shards."""
        return {
            ":now": number(self.clock()),
            ":wsh": {"S": watch_shard(project, run_id)},
            ":lsh": {"S": listing_shard(project, run_id)},
        }

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        """The time part on the run's item when it is newer than what this store knows is recorded there
        (one conditional update: ``created`` with the first, ``received`` and ``watch_shard`` with each,
        ``RECEIVED_SET``); then the step part on the rank groups the activity touches (``_note_group``).

        The run's item is the one the indexes hold, and the only item every note would otherwise write:
        ``shared.ingest.activity.ActivityNotes`` holds a note's time back for up to ``run_time_resolution_s``
        when only its step part is new, so that item is written at most about once a second per process
        however many ranks report, while the step part goes to 16 small items that no index holds."""
        key = (project, run_id)
        if activity.time > self._recorded_times.get(key, -math.inf):
            # With a step part, a time within run_time_resolution_s of the recorded one is left out
            # (RunStore allows it): the run's item, which the indexes copy, then changes at most about
            # once a second however many ingest instances its job's requests reach (a team's hundred
            # runs spread over hundreds of instances, each seeing a run again only after seconds).
            hold = self.run_time_resolution_s if activity.step is not None else 0.0
            values = {":t": number(activity.time), **self._received(project, run_id)}
            newer = "#le < :t"
            if hold > 0:
                values[":held"] = number(activity.time - hold)
                newer = "#le <= :held"
            applied, old = self._update_run_item(
                project,
                run_id,
                f"SET #c = if_not_exists(#c, :t), #le = :t, {RECEIVED_SET}",
                values,
                condition=f"attribute_not_exists(#le) OR {newer}",
                expiring=True,
            )
            # A failed condition: the recorded time is newer, or within the hold of this one, which then
            # counts as recorded (else every later note of this instance within the second fails again,
            # each a write unit).
            recorded = activity.time if applied else max(float(old["last_event"]["N"]), activity.time)
            remember(self._recorded_times, key, recorded)
        if activity.step is not None:
            for group, ranks in rank_groups(activity.ranks):
                self._note_group(project, run_id, group, activity.step, ranks, activity.world_size)

    def _note_group(
        self,
        project: str,
        run_id: str,
        group: str,
        step: int,
        ranks: frozenset[int],
        world_size: int | None,
    ) -> None:
        """Each rank's last step and its world size there, as attributes of the rank's own
        (``s{rank}``, ``w{rank}``; ``sn``, ``wn`` for a step noted without ranks) on its group's item.

        A rank's note only ever grows its own attributes, so the ranks of a group never contend: one
        conditional update (the rank's step grows) applies in the usual case, whatever the other ranks
        did. A newer step replaces the rank's world size; the same step keeps the larger one; an older
        one changes nothing. A failed condition (a late or replayed batch) returns the item as it was,
        which says, rank by rank, what is left to write."""
        members: list[int | None] = [*sorted(ranks)] if ranks else [None]
        item_id = group_item(run_id, group)
        update, values, condition = rank_steps_update(members, step, world_size)
        applied, old = self._update_run_item(project, item_id, update, values, condition, expiring=True)
        if applied:
            return
        for member in members:  # rank by rank: newer, the same step with a larger world size, or older
            s_name, w_name = rank_attributes(member)
            recorded = old.get(s_name)
            recorded_step = int(float(recorded["N"])) if recorded else None
            if recorded_step is not None and recorded_step > step:
                continue
            if recorded_step is None or recorded_step < step:
                update, values, condition = rank_steps_update([member], step, world_size)
            else:
                recorded_ws = int(float(old[w_name]["N"])) if w_name in old else None
                if world_size is None or (recorded_ws is not None and recorded_ws >= world_size):
                    continue
                update = f"SET #{w_name} = :ws"
                values = {":s": number(step), ":ws": number(world_size)}
                condition = f"#{s_name} = :s AND (attribute_not_exists(#{w_name}) OR #{w_name} < :ws)"
            # (another note of the same rank may have raced it: its condition then fails, which is right)
            self._update_run_item(project, item_id, update, values, condition, expiring=True)

    def update_run(
        self,
        project: str,
        run_id: str,
        time: float,
        config: str | None = None,
        finished: bool = False,
        hosts: dict[int, str] | None = None,
    ) -> RunRecord:
        """The config on its own item (``{run_id}#config``: never rewritten with the activity), each
        rank's host as its own attribute ``h{rank}`` of its rank group's item (as its step: ranks never
        contend), then one update of the run's item when ``time`` is the latest activity (the usual case),
        else a second one without the activity part; the record is then read back (one query). An update
        that applies sets ``received`` and ``watch_shard`` too (see ``note_activity``)."""
        if config is not None:
            self._update_run_item(
                project, config_item(run_id), "SET #cfg = :cfg", {":cfg": {"S": config}}, expiring=True
            )
        said = hosts or {}
        for group, ranks in rank_groups(frozenset(said)) if said else []:
            sets = ", ".join(f"#h{rank} = :h{rank}" for rank in sorted(ranks))
            values = {f":h{rank}": {"S": said[rank]} for rank in ranks}
            self._update_run_item(project, group_item(run_id, group), "SET " + sets, values, expiring=True)
        rest = ["#fin = if_not_exists(#fin, :t)"] if finished else []
        applied, _ = self._update_run_item(
            project,
            run_id,
            "SET " + ", ".join(["#c = if_not_exists(#c, :t)", "#le = :t", *rest, RECEIVED_SET]),
            {":t": number(time), **self._received(project, run_id)},
            condition="attribute_not_exists(#le) OR #le < :t",
            expiring=True,
        )
        if applied:
            remember(self._recorded_times, (project, run_id), time)
        elif rest or config is not None:  # a later activity is recorded: the item exists, with ``created``
            self._update_run_item(
                project,
                run_id,
                "SET " + ", ".join([*rest, RECEIVED_SET]),
                {**({":t": number(time)} if finished else {}), **self._received(project, run_id)},
                expiring=True,
            )
        record = self.get_run(project, run_id)
        assert record is not None  # the item has ``last_event`` now
        return record

    def note_findings(self, project: str, run_id: str, findings: str, at: float) -> None:
        """Names only ``run_id``, ``findings`` and ``findings_at`` (the summarize role may touch no
        other attribute): an item exists only with ``last_event``, so ``attribute_exists(run_id)`` is
        the port's "a run that has a record"."""
        self._update_run_item(
            project,
            run_id,
            "SET #f = :f, #fat = :at",
            {":f": {"S": findings}, ":at": number(at)},
            condition="attribute_exists(#r) AND (attribute_not_exists(#fat) OR #fat <= :at)",
        )

    def get_run(self, project: str, run_id: str) -> RunRecord | None:
        """One query of the run's items: its own, its config's and its rank groups'; a second one in the
        project's partition when the run is not in its own (a run recorded before ``run_partition``)."""
        for legacy in (False, True):
            items = self._run_items(project, run_id, run_id, consistent=True, legacy=legacy)
            main = next((item for item in items if item["run_id"]["S"] == run_id), None)
            if main is not None and "last_event" in main:
                return run_record(main, items)
        return None

    def update_process(
        self, project: str, run_id: str, rank: int, change: Callable[[str | None], str | None]
    ) -> None:
        """One item per process (``process_item``), read and written back conditional on its version: a
        racing write of the same rank makes this one read again (a few times at most; one process's
        records come one after another, so a race is a restart's first record against its last)."""
        item_id = process_item(run_id, rank)
        for _ in range(PROCESS_WRITE_TRIES):
            with store_errors("reads"):
                found = self.client.get_item(
                    TableName=self.runs_table, Key=run_key(project, item_id), ConsistentRead=True
                ).get("Item")
            version = int(found["version"]["N"]) if found and "version" in found else 0
            doc = change(found["doc"]["S"] if found and "doc" in found else None)
            if doc is None:
                return
            condition = "attribute_not_exists(#v)" if version == 0 else "#v = :v0"
            values = {":doc": {"S": doc}, ":v1": number(version + 1)} | (
                {":v0": number(version)} if version else {}
            )
            applied, _ = self._update_run_item(
                project, item_id, "SET #doc = :doc, #v = :v1", values, condition=condition, expiring=True
            )
            if applied:
                return

    def processes(self, project: str, run_id: str) -> dict[int, str]:
        """One query of the run's process items (outside the range of its other items); a second one in
        the project's partition when its own has none (a run recorded before ``run_partition``)."""
        return self._processes(project, run_id, False) or self._processes(project, run_id, True)

    def _processes(self, project: str, run_id: str, legacy: bool) -> dict[int, str]:
        low, high = process_items(run_id)
        key = "#p = :p AND #r BETWEEN :low AND :high"
        partition = project if legacy else run_partition(project, run_id)
        query: dict[str, Any] = {
            "TableName": self.runs_table,
            "KeyConditionExpression": key,
            "ExpressionAttributeNames": names(key),
            "ExpressionAttributeValues": {":p": {"S": partition}, ":low": {"S": low}, ":high": {"S": high}},
        }
        found: dict[int, str] = {}
        with store_errors("reads"):
            while True:
                page = self.client.query(**query)
                for item in page.get("Items", []):
                    found[int(item["run_id"]["S"][len(low) :])] = item["doc"]["S"]
                if "LastEvaluatedKey" not in page:
                    return found
                query["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def list_runs(
        self,
        project: str,
        limit: int,
        after: tuple[float, str] | None = None,
        statuses: frozenset[RunStatus] | None = None,
        idle_before: float = 0.0,
    ) -> list[RunRecord]:
        """Queries of ``RUNS_INDEX``, one per listing shard of the project, and one of
        ``LEGACY_RUNS_INDEX`` for the runs recorded before (in parallel), each newest first and stopped
        once it has ``limit`` runs, merged; then one query per listed run for its config and rank groups
        (the index holds neither: both change or weigh too much to be copied into it on every write).

        The index orders by ``last_event`` only; among equal times its order is not defined. So the
        cursor is not an ``ExclusiveStartKey`` but a key condition ``last_event <= cursor`` (the runs
        of the cursor's time are read again and those not after it dropped), and pages are read until
        every run of the last kept time is in hand, then sorted by (``last_event``, ``run_id``)
        descending. Equal float times are rare, so the extra reads are too. A status filter becomes a
        key condition on ``idle_before`` and a filter on ``finished`` where it can
        (``shared.store.dynamodb.layout.expressions.runs_index_query``), and is checked on each record in any
        case. A run recorded before and live since is in both indexes: its newer entry is kept."""
        if limit < 1 or (statuses is not None and not statuses):
            return []
        wanted: frozenset[str] = RUN_STATUSES if statuses is None else statuses
        cursor = None if after is None else after[0]
        parts = [(shard, False) for shard in listing_shards(project)] + [(project, True)]

        def listed(part: tuple[str, bool]) -> list[tuple[RunRecord, dict[str, Any]]]:
            query = runs_index_query(part[0], limit, wanted, idle_before, cursor, legacy=part[1])
            if query is None:
                return []
            return self._newest_listed(
                {"TableName": self.runs_table, **query},
                limit,
                lambda record: run_listed(record, wanted, idle_before, after),
            )

        with ThreadPoolExecutor(max_workers=LISTING_SHARDS + 1) as pool:
            found = [entry for entries in pool.map(listed, parts) for entry in entries]
        found.sort(key=_activity_order, reverse=True)
        seen: set[str] = set()
        entries = []
        for record, item in found:
            if record.run_id not in seen:
                seen.add(record.run_id)
                entries.append(item)
        return [record for _, record in self._merged([(project, item) for item in entries[:limit]], "#")]

    def _newest_listed(
        self, query: dict[str, Any], limit: int, keep: Callable[[RunRecord], bool]
    ) -> list[tuple[RunRecord, dict[str, Any]]]:
        """The newest ``limit`` index entries that ``keep`` keeps, as records and items: pages are read
        until every run of the last kept time is in hand (the index orders equal times in no defined
        way), then ordered by (``last_event``, ``run_id``) descending."""
        entries: list[tuple[RunRecord, dict[str, Any]]] = []
        with store_errors("reads"):
            while True:
                page = self.client.query(**query)
                for item in page.get("Items", []):
                    record = run_record(item)
                    if keep(record):
                        entries.append((record, item))
                last = page.get("LastEvaluatedKey")
                if last is None:
                    break
                if len(entries) >= limit:
                    entries.sort(key=_activity_order, reverse=True)
                    if float(last["last_event"]["N"]) < entries[limit - 1][0].last_event:
                        break  # every run of the last kept time is read
                query["ExclusiveStartKey"] = last
        entries.sort(key=_activity_order, reverse=True)
        return entries[:limit]
