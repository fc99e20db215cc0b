"""A project's webhooks (``AlertStore``): one item of the alerts table (``project``, ``webhooks``: JSON
text)."""

from __future__ import annotations

import json
from dataclasses import asdict

from shared.store.dynamodb.base import DynamoBase
from shared.store.dynamodb.errors import store_errors
from shared.store.port import Webhook


class AlertsMixin(DynamoBase):
    """Webhooks in the alerts table."""

    def get_webhooks(self, project: str) -> list[Webhook]:
        with store_errors("reads"):
            item = self.client.get_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ConsistentRead=True
            ).get("Item")
        if item is None:
            return []
        return [Webhook(**hook) for hook in json.loads(item["webhooks"]["S"])]

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        text = json.dumps([asdict(hook) for hook in webhooks], separators=(",", ":"))
        with store_errors("writes"):
            self.client.put_item(
                TableName=self.alerts_table, Item={"project": {"S": project}, "webhooks": {"S": text}}
            )

    def delete_webhooks(self, project: str) -> bool:
        with store_errors("writes"):
            answer = self.client.delete_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ReturnValues="ALL_OLD"
            )
        return "Attributes" in answer
