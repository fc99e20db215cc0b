"""The runs table's two moves, shared by the run records and the watch: one conditional update of an item,
and a run's items read by their key range (one query), which make an index entry whole."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.store.dynamodb.base import DynamoBase
from shared.store.dynamodb.errors import condition_failed, store_errors
from shared.store.dynamodb.layout.codecs import run_record
from shared.store.dynamodb.layout.expressions import names, with_expires
from shared.store.dynamodb.layout.keys import RUN_ITEMS_END, run_key, run_partition
from shared.store.port import RunRecord


class RunTable(DynamoBase):
    """Items of the runs table: a run's own, its config's and its rank groups'."""

    def _update_run_item(
        self,
        project: str,
        run_id: str,
        update: str,
        values: dict[str, Any],
        condition: str | None = None,
        return_new: bool = False,
        expiring: bool = False,
    ) -> tuple[bool, dict[str, Any]]:
        """One ``UpdateItem`` of an item of the runs table (a run's, or its config's or rank group's):
        (True, the new item when ``return_new``) when applied, (False, the item as it was) when
        ``condition`` failed. ``expiring``: it sets ``expires`` too, when the deployment keeps a
        retention (never in the updates of roles that may not name it: findings, the watch's)."""
        from botocore.exceptions import ClientError

        if expiring:
            values = dict(values)
            update = with_expires(update, values, self._expires())

        request: dict[str, Any] = {
            "TableName": self.runs_table,
            "Key": run_key(project, run_id),
            "UpdateExpression": update,
            "ExpressionAttributeNames": names(update, condition or ""),
            "ExpressionAttributeValues": values,
        }
        if condition is not None:
            request["ConditionExpression"] = condition
            request["ReturnValuesOnConditionCheckFailure"] = "ALL_OLD"
        if return_new:
            request["ReturnValues"] = "ALL_NEW"
        with store_errors("writes"):
            try:
                answer = self.client.update_item(**request)
            except ClientError as exc:
                if not condition_failed(exc):
                    raise
                return False, exc.response.get("Item", {})  # type: ignore[return-value]
        return True, answer.get("Attributes", {})

    def _run_items(
        self, project: str, run_id: str, low: str, consistent: bool = False, legacy: bool = False
    ) -> list[dict[str, Any]]:
        """The run's items from ``low`` on (the run's own id: all of them; ``{run_id}#``: its config and
        rank groups; ``{run_id}#s``: its rank groups), in its partition (``legacy``: the project's, where
        the run ids of other runs never fall in the range, since ``#`` sorts before every character a run
        id may hold)."""
        key = "#p = :p AND #r BETWEEN :low AND :high"
        query: dict[str, Any] = {
            "TableName": self.runs_table,
            "KeyConditionExpression": key,
            "ExpressionAttributeNames": names(key),
            "ExpressionAttributeValues": {
                ":p": {"S": project if legacy else run_partition(project, run_id)},
                ":low": {"S": low},
                ":high": {"S": run_id + RUN_ITEMS_END},
            },
            "ConsistentRead": consistent,
        }
        items: list[dict[str, Any]] = []
        with store_errors("reads"):
            while True:
                page = self.client.query(**query)
                items += page.get("Items", [])
                if "LastEvaluatedKey" not in page:
                    return items
                query["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def _merged(self, runs: list[tuple[str, dict[str, Any]]], side: str) -> list[tuple[str, RunRecord]]:
        """Index entries (project, item) made whole with their runs' own items after ``{run_id}{side}``
        (``#``: config and rank groups; ``#s``: rank groups only), queried in parallel."""

        def one(run: tuple[str, dict[str, Any]]) -> tuple[str, RunRecord]:
            project, item = run
            run_id = item["run_id"]["S"]
            legacy = item["project"]["S"] != run_partition(project, run_id)
            return project, run_record(item, self._run_items(project, run_id, run_id + side, legacy=legacy))

        if len(runs) <= 1:
            return [one(run) for run in runs]
        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(one, runs))
