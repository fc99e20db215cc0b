"""Per-block rollups, kept in the metrics table beside the events (see ``shared.rollups``).

Item layout, in the same table as the events (its ``pk``/``sk`` schema), under partition keys that start
with ``@`` (no project name can, so they never meet an event's partition):

- block item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``{block:016d}``; ``h`` =
  ``BlockHeader.packed()`` (first and last step, distinct steps, world size, events read, and per rank
  steps reported, first and last step when some rank missed a step), ``k`` = the block's keys joined
  by newlines, ``n`` = events read.
- key item: ``pk`` = ``@rollup#{project}#{run_id}#{key}``, ``sk`` = ``{block:016d}``; ``v`` = that key's
  sums over the block per rank (``rollups.pack_key_units``: 24 bytes a rank, 12 KB at 512 ranks), ``n``.
- progress item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``~progress``: ``f`` = every block up
  to this one has been rolled up (or had no events when it was looked at).

Every put is conditional on ``n`` (or ``f``) growing: events are only ever added, so a rollup
that read more events is the newer one, and two rollers racing on one block leave the newer result.

Only the rollup function writes here: its policy allows ``dynamodb:PutItem`` on the table with the
condition ``dynamodb:LeadingKeys`` like ``@rollup#*`` (template.yaml), so it can never change an event.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from shared.rollups import BlockHeader, RolledBlock, unpack_header
from shared.store import PARTITION_KEY, SORT_KEY, MetricsStore, store_errors

ROLLUP_PREFIX = "@rollup#"
PROGRESS_SK = "~progress"  # sorts after every block number
_DIGITS = 16


def block_partition(project: str, run_id: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}"


def key_partition(project: str, run_id: str, key: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}#{key}"


class RollupStore:
    """Reads and writes rolled blocks through a :class:`MetricsStore`'s client and table."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def blocks(self, project: str, run_id: str, first: int, last: int) -> list[BlockHeader]:
        """The rolled blocks ``first <= block <= last`` of a run, in block order."""
        return [
            unpack_header(int(item[SORT_KEY]["S"]), item["h"]["B"], item["k"]["S"].split("\n"))
            for item in self._query(block_partition(project, run_id), first, last, "#sk, h, k")
        ]

    def key_sums(
        self, project: str, run_id: str, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        """For each key, block -> packed sums, the keys queried in parallel."""

        def one(key: str) -> dict[int, bytes]:
            items = self._query(key_partition(project, run_id, key), first, last, "#sk, v")
            return {int(item[SORT_KEY]["S"]): item["v"]["B"] for item in items}

        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(zip(keys, pool.map(one, keys), strict=True))

    def put(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        """Write rolled blocks: each key's sums first, the block item last (it makes the block used)."""

        def put_block(rolled: RolledBlock) -> None:
            block = rolled.header
            sk = {"S": f"{block.block:0{_DIGITS}d}"}
            n = {"N": str(block.n_events)}
            for key, packed in rolled.sums.items():
                self._put_if_newer(
                    {
                        PARTITION_KEY: {"S": key_partition(project, run_id, key)},
                        SORT_KEY: sk,
                        "v": {"B": packed},
                        "n": n,
                    }
                )
            self._put_if_newer(
                {
                    PARTITION_KEY: {"S": block_partition(project, run_id)},
                    SORT_KEY: sk,
                    "h": {"B": block.packed()},
                    "k": {"S": "\n".join(block.keys)},
                    "n": n,
                }
            )

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(put_block, rolled))

    def rolled_through(self, project: str, run_id: str) -> int:
        """Every block up to the returned one has been rolled up; -1 before the first."""
        with store_errors("reads"):
            item = self.store.client.get_item(
                TableName=self.store.table_name,
                Key={PARTITION_KEY: {"S": block_partition(project, run_id)}, SORT_KEY: {"S": PROGRESS_SK}},
                ConsistentRead=True,
            ).get("Item")
        return -1 if item is None else int(item["f"]["N"])

    def set_rolled_through(self, project: str, run_id: str, block: int) -> None:
        """Record progress unless another roller already recorded more."""
        self._put_if_newer(
            {
                PARTITION_KEY: {"S": block_partition(project, run_id)},
                SORT_KEY: {"S": PROGRESS_SK},
                "f": {"N": str(block)},
            },
            "attribute_not_exists(#pk) OR f <= :f",
            {":f": {"N": str(block)}},
        )

    def _put_if_newer(
        self,
        item: dict[str, Any],
        condition: str = "attribute_not_exists(#pk) OR n <= :n",
        values: dict[str, Any] | None = None,
    ) -> None:
        try:
            with store_errors("writes"):
                self.store.client.put_item(
                    TableName=self.store.table_name,
                    Item=item,
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#pk": PARTITION_KEY},
                    ExpressionAttributeValues=values or {":n": item["n"]},
                )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            # another roller wrote a rollup that read more events (or recorded more progress)

    def _query(self, pk: str, first: int, last: int, projection: str) -> Iterator[dict[str, Any]]:
        with store_errors("reads"):
            yield from self._read(pk, first, last, projection)

    def _read(self, pk: str, first: int, last: int, projection: str) -> Iterator[dict[str, Any]]:
        paginator = self.store.client.get_paginator("query")
        pages = paginator.paginate(
            TableName=self.store.table_name,
            KeyConditionExpression="#pk = :pk AND #sk BETWEEN :low AND :high",
            ExpressionAttributeNames={"#pk": PARTITION_KEY, "#sk": SORT_KEY},
            ExpressionAttributeValues={
                ":pk": {"S": pk},
                ":low": {"S": f"{first:0{_DIGITS}d}"},
                ":high": {"S": f"{last:0{_DIGITS}d}"},
            },
            ProjectionExpression=projection,
        )
        for page in pages:
            yield from page.get("Items", [])
