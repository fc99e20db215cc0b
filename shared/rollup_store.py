"""Sealed per-block rollups, kept in the metrics table beside the events (see ``shared.rollups``).

Item layout, in the same table as the events (its ``pk``/``sk`` schema), under partition keys that start
with ``@`` (no project name can, so they never meet an event's partition):

- block item: ``pk`` = ``@rollup#{project}#{run_id}``, ``sk`` = ``{block:016d}``; ``h`` = little-endian
  int64 ``[first_step, last_step, n_steps, world_size]``, ``k`` = the block's keys joined by newlines.
- key item: ``pk`` = ``@rollup#{project}#{run_id}#{key}``, ``sk`` = ``{block:016d}``; ``v`` = that key's
  sums over the block per rank (``rollups.pack_key_units``: 24 bytes a rank, 12 KB at 512 ranks).

The summarize function may write only these partitions: its policy allows ``dynamodb:PutItem`` on the
table with the condition ``dynamodb:LeadingKeys`` like ``@rollup#*`` (template.yaml).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shared.rollups import SealedBlock
from shared.store import PARTITION_KEY, SORT_KEY, MetricsStore, store_errors

ROLLUP_PREFIX = "@rollup#"
_DIGITS = 16


def block_partition(project: str, run_id: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}"


def key_partition(project: str, run_id: str, key: str) -> str:
    return f"{ROLLUP_PREFIX}{project}#{run_id}#{key}"


@dataclass(frozen=True, slots=True)
class BlockHeader:
    block: int
    first_step: int
    last_step: int
    n_steps: int
    world_size: int
    keys: list[str]


class RollupStore:
    """Reads and writes sealed blocks through a :class:`MetricsStore`'s client and table."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def blocks(self, project: str, run_id: str, first: int, last: int) -> list[BlockHeader]:
        """The sealed blocks ``first <= block <= last`` of a run, in block order."""
        headers = []
        for item in self._query(block_partition(project, run_id), first, last, "#sk, h, k"):
            first_step, last_step, n_steps, world_size = struct.unpack("<4q", item["h"]["B"])
            headers.append(
                BlockHeader(
                    int(item[SORT_KEY]["S"]),
                    first_step,
                    last_step,
                    n_steps,
                    world_size,
                    item["k"]["S"].split("\n"),
                )
            )
        return headers

    def key_sums(
        self, project: str, run_id: str, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        """For each key, block -> packed sums, the keys queried in parallel."""

        def one(key: str) -> dict[int, bytes]:
            items = self._query(key_partition(project, run_id, key), first, last, "#sk, v")
            return {int(item[SORT_KEY]["S"]): item["v"]["B"] for item in items}

        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(zip(keys, pool.map(one, keys), strict=True))

    def put(self, project: str, run_id: str, sealed: list[SealedBlock]) -> None:
        """Write sealed blocks: each key's sums first, the block item last (it marks the block sealed)."""
        table, client = self.store.table_name, self.store.client

        def put_block(block: SealedBlock) -> None:
            sk = {"S": f"{block.block:0{_DIGITS}d}"}
            for key, packed in block.keys.items():
                client.put_item(
                    TableName=table,
                    Item={
                        PARTITION_KEY: {"S": key_partition(project, run_id, key)},
                        SORT_KEY: sk,
                        "v": {"B": packed},
                    },
                )
            client.put_item(
                TableName=table,
                Item={
                    PARTITION_KEY: {"S": block_partition(project, run_id)},
                    SORT_KEY: sk,
                    "h": {"B": block.header()},
                    "k": {"S": "\n".join(block.keys)},
                },
            )

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(put_block, sealed))

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
