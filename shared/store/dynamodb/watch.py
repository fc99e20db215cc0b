"""The watch's side of the runs table (``WatchStore``): every project's recently received runs, listed from
the ``by_received`` index, and a round's result saved after its alerts are on the alerts queue (SQS)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shared.errors import StoreThrottled, StoreUnavailable
from shared.store.dynamodb.errors import THROTTLED, queue_errors, store_errors
from shared.store.dynamodb.layout.codecs import number, pack_watch
from shared.store.dynamodb.layout.expressions import names
from shared.store.dynamodb.layout.keys import (
    WATCH_INDEX,
    WATCH_SHARDS,
    project_of_partition,
    watch_shards,
)
from shared.store.dynamodb.run_table import RunTable
from shared.store.port import Delivery, RunRecord

if TYPE_CHECKING:
    from mypy_boto3_sqs.type_defs import SendMessageBatchRequestEntryTypeDef

#: Messages per ``SendMessageBatch`` (SQS's most).
SQS_BATCH = 10


class WatchMixin(RunTable):
    """The watch's list of runs and its saved rounds (contract 7)."""

    def watched_runs(self, received_after: float, limit: int) -> list[tuple[str, RunRecord]]:
        """One query of ``WATCH_INDEX`` per watch shard (``WATCH_SHARDS``, in parallel), newest
        ``received`` first, each stopped once it has ``limit`` runs; merged, the newest ``limit``.

        The index holds the watch's state and the run's times; the step part (the last step, its ranks
        and world size) is then read from each listed run's rank groups, one small query a run (about
        0.5 read units): the groups change with every rank's batch, so no index copies them."""
        if limit < 1:
            return []
        key = "#wsh = :wsh AND #rcv >= :after"

        def shard(value: str) -> list[tuple[str, dict[str, Any]]]:
            query: dict[str, Any] = {
                "TableName": self.runs_table,
                "IndexName": WATCH_INDEX,
                "KeyConditionExpression": key,
                "ExpressionAttributeNames": names(key),
                "ExpressionAttributeValues": {":wsh": {"S": value}, ":after": number(received_after)},
                "ScanIndexForward": False,
                "Limit": min(limit, 1000),
            }
            found: list[tuple[str, dict[str, Any]]] = []
            with store_errors("reads"):
                while len(found) < limit:
                    page = self.client.query(**query)
                    found += [
                        (project_of_partition(item["project"]["S"], item["run_id"]["S"]), item)
                        for item in page.get("Items", [])
                        if "last_event" in item
                    ]
                    if "LastEvaluatedKey" not in page:
                        break
                    query["ExclusiveStartKey"] = page["LastEvaluatedKey"]
            return found[:limit]

        with ThreadPoolExecutor(max_workers=WATCH_SHARDS) as pool:
            entries = [entry for part in pool.map(shard, watch_shards()) for entry in part]

        def order(entry: tuple[str, dict[str, Any]]) -> tuple[float, str, str]:
            project, item = entry
            received = float(item["received"]["N"]) if "received" in item else 0.0
            return received, project, item["run_id"]["S"]

        entries.sort(key=order, reverse=True)
        seen: set[tuple[str, str]] = set()  # a run recorded before run_partition and live since: the newer
        unique = []
        for project, item in entries:
            if (project, item["run_id"]["S"]) not in seen:
                seen.add((project, item["run_id"]["S"]))
                unique.append((project, item))
        return self._merged(unique[:limit], "#s")

    def save_watch(
        self,
        project: str,
        run_id: str,
        state: str,
        counts: str,
        headline: str | None,
        at: float,
        deliveries: list[Delivery],
    ) -> None:
        """The round's deliveries onto the alerts queue first, then its result on the run's item.

        DynamoDB and SQS share no transaction, so the order makes "neither kept without the other" hold
        one way: a crash after the messages and before the update leaves the run's state as it was,
        and the next round takes the same decision again, with the same delivery ids (``shared.watch.rounds``
        names a delivery by its run, finding, onset, state and webhook). The queue may then hold that
        alert twice; it is never lost. Duplicates are bounded: one extra copy per crash (or failed
        update) between the two calls, each carrying the same ``X-InstantML-Delivery`` id, so a receiver
        that keeps recent ids drops it. (SQS's own deduplication works only on a FIFO queue, whose
        5-minute window would not cover a round repeated later either, and whose ordering would let one
        dead webhook hold back every alert behind it in its group: the queue stays standard, whose
        at-least-once delivery already means a receiver may see a repeat.) The other order would lose
        an alert whenever the send failed after the update.

        One ``UpdateItem`` names only the attributes the watch role may write (template.yaml:
        ``watch``, ``findings``, ``findings_at``, ``headline`` and the keys). The state is stored
        compressed (``pack_watch``). ``shared.watch.rounds`` caps the findings it keeps (``KEPT_FINDINGS``)
        but not its open alerts: with 511 of 512 ranks stopped while one goes on, the state is 242 KB of JSON
        (575 open alerts), 10 KB compressed, and the run item 10.5 KB, against DynamoDB's 400 KB item
        (``benchmarks/watch_dynamodb.py`` prints it)."""
        self._send(deliveries)
        update = "SET #w = :w, #f = :f, #fat = :at" + (", #hl = :hl" if headline else " REMOVE #hl")
        values: dict[str, Any] = {":w": {"B": pack_watch(state)}, ":f": {"S": counts}, ":at": number(at)}
        if headline:
            values[":hl"] = {"S": headline}
        self._update_run_item(project, run_id, update, values, condition="attribute_exists(#r)")

    def _send(self, deliveries: list[Delivery]) -> None:
        """``SendMessageBatch`` 10 messages a call (SQS's most), each body what ``functions.deliver``
        reads. A message that SQS did not take fails the round for this run (it is retried whole)."""
        bodies = [
            json.dumps(
                {"delivery_id": d.delivery_id, "project": d.project, "url": d.url, "payload": d.payload},
                separators=(",", ":"),
                allow_nan=False,
            )
            for d in deliveries
        ]
        for i in range(0, len(bodies), SQS_BATCH):
            entries: list[SendMessageBatchRequestEntryTypeDef] = [
                {"Id": str(n), "MessageBody": body} for n, body in enumerate(bodies[i : i + SQS_BATCH])
            ]
            with queue_errors():
                answer = self.sqs.send_message_batch(QueueUrl=self.alerts_queue, Entries=entries)
            failed = answer.get("Failed") or []
            if failed:
                codes = sorted({f.get("Code", "?") for f in failed})
                if any(code in THROTTLED for code in codes):
                    raise StoreThrottled(
                        f"the alerts queue is throttling ({', '.join(codes)}); retry shortly"
                    )
                raise StoreUnavailable(f"the alerts queue refused {len(failed)} alerts ({', '.join(codes)})")
