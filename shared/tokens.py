"""Per-project API tokens (contract 3.1): made, stored as hashes, looked up, revoked.

A token is ``iml_<token_id>_<secret>``: 256 bits of secret from ``secrets``, shown once at creation.
The tokens table keeps only its SHA-256 (``token_hash``, the partition key), the project it grants,
and the public ``token_id`` used to list and revoke it. A record whose project is ``*`` grants every
project: only the local stack makes one, for the single token it prints.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_boto3_dynamodb import DynamoDBClient

HASH_KEY = "token_hash"
ANY_PROJECT = "*"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """A fresh token and its public id."""
    token_id = secrets.token_hex(4)
    return f"iml_{token_id}_{secrets.token_urlsafe(32)}", token_id


@dataclass(frozen=True)
class TokenRecord:
    token_id: str
    project: str
    created: float
    revoked: bool = False
    description: str = ""

    def grants(self, project: str) -> bool:
        return not self.revoked and (
            self.project == ANY_PROJECT or hmac.compare_digest(self.project, project)
        )


class TokenStore:
    """The tokens table. The authorizer only reads (GetItem); operators create, list and revoke."""

    def __init__(self, table_name: str, client: DynamoDBClient | None = None) -> None:
        self.table_name = table_name
        self._client = client

    @property
    def client(self) -> DynamoDBClient:
        if self._client is None:
            import boto3

            self._client = boto3.client("dynamodb")
        return self._client

    def lookup(self, token: str) -> TokenRecord | None:
        """The record of a presented token, or None when it is unknown."""
        digest = token_hash(token)
        item = self.client.get_item(TableName=self.table_name, Key={HASH_KEY: {"S": digest}}).get("Item")
        if item is None or not hmac.compare_digest(item[HASH_KEY]["S"], digest):
            return None
        return _record(item)

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
            records += [_record(item) for item in page.get("Items", [])]
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


def _record(item: dict[str, Any]) -> TokenRecord:
    return TokenRecord(
        token_id=item["token_id"]["S"],
        project=item["project"]["S"],
        created=float(item["created"]["N"]),
        revoked=bool(item.get("revoked", {}).get("BOOL", False)),
        description=item.get("description", {}).get("S", ""),
    )


class TokenCache:
    """Token hash -> record for ``ttl`` seconds, in a warm authorizer: one table read per token per TTL.

    A revoked token therefore stops working within ``ttl`` seconds.
    """

    def __init__(self, store: TokenStore, ttl: float = 60.0, max_entries: int = 10_000) -> None:
        self.store, self.ttl, self.max_entries = store, ttl, max_entries
        self._entries: dict[str, tuple[float, TokenRecord | None]] = {}

    def lookup(self, token: str, now: float | None = None) -> TokenRecord | None:
        now = time.monotonic() if now is None else now
        digest = token_hash(token)
        cached = self._entries.get(digest)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        record = self.store.lookup(token)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = (now, record)
        return record


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
