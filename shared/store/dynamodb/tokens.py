"""Tokens (``shared.tokens``) in the tokens table, keyed by the token's hash."""

from __future__ import annotations

import hmac
import secrets
import time
from typing import TYPE_CHECKING, Any

from shared.tokens import HASH_KEY, TokenRecord, new_token, token_hash

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient


class DynamoTokenStore:
    """Tokens (``shared.tokens``) in the tokens table. The authorizer only reads (GetItem); operators
    create, list and revoke."""

    def __init__(self, table_name: str, client: DynamoDBClient | None = None) -> None:
        self.table_name = table_name
        self._client = client

    @property
    def client(self) -> DynamoDBClient:
        if self._client is None:
            import boto3

            self._client = boto3.client("dynamodb")
        return self._client

    def lookup_hash(self, digest: str) -> TokenRecord | None:
        """The record of the token hashed to ``digest``, or None when it is unknown."""
        item = self.client.get_item(TableName=self.table_name, Key={HASH_KEY: {"S": digest}}).get("Item")
        if item is None or not hmac.compare_digest(item[HASH_KEY]["S"], digest):
            return None
        return _token_record(item)

    def create(
        self, project: str, description: str = "", token: str | None = None
    ) -> tuple[str, TokenRecord]:
        """Store a new token for ``project``; returns the token (shown once) and its record."""
        token_id = secrets.token_hex(4)
        if token is None:
            token, token_id = new_token()
        record = TokenRecord(token_id, project, time.time(), False, description)
        self.client.put_item(
            TableName=self.table_name,
            Item={
                HASH_KEY: {"S": token_hash(token)},
                "token_id": {"S": record.token_id},
                "project": {"S": record.project},
                "created": {"N": f"{record.created:.3f}"},
                "revoked": {"BOOL": False},
                "description": {"S": description},
            },
            ConditionExpression="attribute_not_exists(#h)",
            ExpressionAttributeNames={"#h": HASH_KEY},
        )
        return token, record

    def list(self, project: str | None = None) -> list[TokenRecord]:
        records = []
        for page in self.client.get_paginator("scan").paginate(TableName=self.table_name):
            records += [_token_record(item) for item in page.get("Items", [])]
        return sorted((r for r in records if project in (None, r.project)), key=lambda r: r.created)

    def revoke(self, token_id: str) -> bool:
        """Mark the token with this public id revoked; False when there is none."""
        for page in self.client.get_paginator("scan").paginate(
            TableName=self.table_name,
            FilterExpression="token_id = :id",
            ExpressionAttributeValues={":id": {"S": token_id}},
        ):
            for item in page.get("Items", []):
                self.client.update_item(
                    TableName=self.table_name,
                    Key={HASH_KEY: item[HASH_KEY]},
                    UpdateExpression="SET revoked = :true",
                    ExpressionAttributeValues={":true": {"BOOL": True}},
                )
                return True
        return False


def _token_record(item: dict[str, Any]) -> TokenRecord:
    return TokenRecord(
        token_id=item["token_id"]["S"],
        project=item["project"]["S"],
        created=float(item["created"]["N"]),
        revoked=bool(item.get("revoked", {}).get("BOOL", False)),
        description=item.get("description", {}).get("S", ""),
    )
