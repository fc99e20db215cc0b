"""A project's webhooks (``AlertStore``): one item of the alerts table (``project``, ``webhooks``: JSON
text), and in it one small attribute per webhook for how its last POST went (``delivery_<hash of the
URL>``: state, reason, time), overwritten by the deliver function. A ``PUT`` replaces the webhooks and
keeps those notes (a webhook no longer listed is no longer read); ``DELETE`` removes the item."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from shared.store.dynamodb.base import DynamoBase
from shared.store.dynamodb.errors import condition_failed, store_errors
from shared.store.port import LastDelivery, Webhook


def delivery_attribute(url: str) -> str:
    """The alerts item's attribute that notes the last delivery to ``url`` (its hash: the URL is a
    secret, and attribute names appear in logs and errors)."""
    return "delivery_" + hashlib.sha256(url.encode()).hexdigest()[:32]


class AlertsMixin(DynamoBase):
    """Webhooks in the alerts table."""

    def _alerts_item(self, project: str) -> dict[str, Any] | None:
        with store_errors("reads"):
            item: dict[str, Any] | None = self.client.get_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ConsistentRead=True
            ).get("Item")
        return item

    def get_webhooks(self, project: str) -> list[Webhook]:
        item = self._alerts_item(project)
        if item is None:
            return []
        return [Webhook(**hook) for hook in json.loads(item["webhooks"]["S"])]

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        text = json.dumps([asdict(hook) for hook in webhooks], separators=(",", ":"))
        with store_errors("writes"):
            self.client.update_item(
                TableName=self.alerts_table,
                Key={"project": {"S": project}},
                UpdateExpression="SET webhooks = :w",
                ExpressionAttributeValues={":w": {"S": text}},
            )

    def note_delivery(self, project: str, url: str, last: LastDelivery) -> None:
        note: dict[str, Any] = {"state": {"S": last.state}, "at": {"N": repr(float(last.at))}}
        if last.reason:
            note["reason"] = {"S": last.reason[:500]}
        from botocore.exceptions import ClientError

        try:
            with store_errors("writes"):
                self.client.update_item(
                    TableName=self.alerts_table,
                    Key={"project": {"S": project}},
                    UpdateExpression="SET #d = :d",
                    ConditionExpression="attribute_exists(webhooks)",
                    ExpressionAttributeNames={"#d": delivery_attribute(url)},
                    ExpressionAttributeValues={":d": {"M": note}},
                )
        except ClientError as exc:
            if not condition_failed(exc):  # the project's webhooks are gone: nothing to note
                raise

    def last_deliveries(self, project: str) -> dict[str, LastDelivery]:
        item = self._alerts_item(project)
        if item is None:
            return {}
        found = {}
        for hook in json.loads(item["webhooks"]["S"]):
            note = item.get(delivery_attribute(hook["url"]), {}).get("M")
            if note is not None:
                reason = note.get("reason", {}).get("S")
                found[hook["url"]] = LastDelivery(note["state"]["S"], reason, float(note["at"]["N"]))
        return found

    def delete_webhooks(self, project: str) -> bool:
        with store_errors("writes"):
            answer = self.client.delete_item(
                TableName=self.alerts_table, Key={"project": {"S": project}}, ReturnValues="ALL_OLD"
            )
        return "Attributes" in answer
