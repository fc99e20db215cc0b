"""Rollups (``RollupStore``) beside the events in the metrics table: block items, key items and the progress
item under ``@rollup#`` partitions, each put only if it read more events than the one it replaces."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.rollups import BlockHeader, RolledBlock, unpack_header
from shared.store.dynamodb.base import DynamoBase
from shared.store.dynamodb.errors import condition_failed, store_errors
from shared.store.dynamodb.layout.codecs import block_sums
from shared.store.dynamodb.layout.expressions import key_range_query
from shared.store.dynamodb.layout.keys import (
    PARTITION_KEY,
    PROGRESS_SK,
    SORT_KEY,
    block_of_sort_key,
    block_partition,
    block_sort_key,
    block_window,
    key_partition,
)
from shared.store.port import RollupProgress

#: zlib's level for a key's sums (``vz``): 24 bytes a rank become about 8 (a rank's total stays about
#: 8 bytes, its weight sum and counts repeat across ranks), a third of the write and read units.
SUMS_COMPRESSION = 6


class RollupsMixin(DynamoBase):
    """Rolled blocks in the metrics table; written only by the rollup function."""

    def read_blocks(self, project: str, run_id: str, size: int, first: int, last: int) -> list[BlockHeader]:
        """The rolled blocks of one level, ``first <= block <= last``, in block order. Each block's
        events read (``n``) is remembered: ``read_block_sums`` takes unchanged blocks' sums from its
        cache."""
        items = self._query_rollups(block_partition(project, run_id), size, first, last, "#sk, h, k")
        headers = [
            unpack_header(
                size, block_of_sort_key(item[SORT_KEY]["S"]), item["h"]["B"], item["k"]["S"].split("\n")
            )
            for item in items
        ]
        self._sums.saw(project, run_id, size, {h.block: h.n_events for h in headers})
        return headers

    def read_block_sums(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        """For each key, block -> packed sums, the keys queried in parallel: only the blocks whose sums
        this store has not cached for the events read its last ``read_blocks`` saw (``SumsCache``),
        one query per run of consecutive such blocks."""
        cached, ranges = self._sums.lookup(project, run_id, size, keys, first, last)

        def one(key: str) -> list[dict[str, Any]]:
            pk = key_partition(project, run_id, key)
            return [
                item
                for low, high in ranges[key]
                for item in self._query_rollups(pk, size, low, high, "#sk, v, vz, n")
            ]

        with ThreadPoolExecutor(max_workers=8) as pool:
            read = dict(zip(keys, pool.map(one, keys), strict=True))
        for key, items in read.items():
            for item in items:
                block = block_of_sort_key(item[SORT_KEY]["S"])
                sums = block_sums(item)
                cached[key][block] = sums
                self._sums.keep(project, run_id, size, key, block, int(item["n"]["N"]), sums)
        return {key: dict(sorted(blocks.items())) for key, blocks in cached.items()}

    def write_blocks(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        """Write rolled blocks: each key's sums first, the block item last (it makes the block used)."""

        def put_block(rolled: RolledBlock) -> None:
            block = rolled.header
            sk = {"S": block_sort_key(block.size, block.block)}
            n = {"N": str(block.n_events)}
            for key, packed in rolled.sums.items():  # kept: the blocks above are combined from these
                self._sums.keep(project, run_id, block.size, key, block.block, block.n_events, packed)
                self._put_if_newer(
                    {
                        PARTITION_KEY: {"S": key_partition(project, run_id, key)},
                        SORT_KEY: sk,
                        "vz": {"B": zlib.compress(packed, SUMS_COMPRESSION)},
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

    def rollup_progress(self, project: str, run_id: str) -> RollupProgress:
        with store_errors("reads"):
            item = self.client.get_item(
                TableName=self.table_name,
                Key={PARTITION_KEY: {"S": block_partition(project, run_id)}, SORT_KEY: {"S": PROGRESS_SK}},
                ConsistentRead=True,
            ).get("Item")
        return RollupProgress() if item is None else RollupProgress(int(item["f"]["N"]), item["nodes"]["B"])

    def late_steps(self, project: str, run_id: str, step_min: int, step_max: int, limit: int) -> list[int]:
        """None known: the stream's backlog is not readable here, and marking late steps at ingest would
        cost write units on every event. A late rank's events are in the summary once the rollup function
        has read them from the stream (its batching window, about a second)."""
        return []

    def advance_rollups(self, project: str, run_id: str, step: int, nodes: bytes) -> None:
        """Record progress unless another roller already recorded more."""
        self._put_if_newer(
            {
                PARTITION_KEY: {"S": block_partition(project, run_id)},
                SORT_KEY: {"S": PROGRESS_SK},
                "f": {"N": str(step)},
                "nodes": {"B": nodes},
            },
            "attribute_not_exists(#pk) OR f <= :f",
            {":f": {"N": str(step)}},
        )

    def _put_if_newer(
        self,
        item: dict[str, Any],
        condition: str = "attribute_not_exists(#pk) OR n <= :n",
        values: dict[str, Any] | None = None,
    ) -> None:
        from botocore.exceptions import ClientError

        try:
            with store_errors("writes"):
                self.client.put_item(
                    TableName=self.table_name,
                    Item=item,
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#pk": PARTITION_KEY},
                    ExpressionAttributeValues=values or {":n": item["n"]},
                )
        except ClientError as exc:
            if not condition_failed(exc):
                raise
            # another roller wrote a rollup that read more events (or recorded more progress)

    def _query_rollups(
        self, pk: str, size: int, first: int, last: int, projection: str
    ) -> Iterator[dict[str, Any]]:
        with store_errors("reads"):
            yield from self._read_rollups(pk, size, first, last, projection)

    def _read_rollups(
        self, pk: str, size: int, first: int, last: int, projection: str
    ) -> Iterator[dict[str, Any]]:
        query = key_range_query(self.table_name, pk, *block_window(size, first, last))
        for page in self.client.get_paginator("query").paginate(**query, ProjectionExpression=projection):
            yield from page.get("Items", [])
