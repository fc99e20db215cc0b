"""Lambda authorizer of the HTTP API (payload 2.0, simple responses): token -> project.

It always answers ``isAuthorized: true`` and puts its verdict in the context, so that the function
behind the route answers a bad token in the contract's error shape (401/403 with a JSON ``error``)
rather than API Gateway's bare ``{"message": "Forbidden"}``. Functions deny any request whose context
does not grant the project in its path (functions/api.py).

Deployed, API Gateway keeps each token's verdict for ``AuthorizerCacheSeconds`` (template.yaml, 60 s),
keyed by the ``Authorization`` header: a 512-rank job's requests call this function about once a minute,
not once each. That cache needs the header, so a request without one is answered by API Gateway itself
(401, its own body). Lookups are also cached here for 60 s on DynamoDB (``shared.tokens.TokenCache``), so
a revoked token works up to two minutes more. The local stack calls this function for every request
and its SQLite store caches nothing (``cache_ttl_s`` 0): a lookup costs microseconds, a revocation is
seen by the next request, and a missing header gets the contract's 401.
"""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.typing import LambdaContext

from shared.store import STORE_URL_ENV, open_token_store
from shared.tokens import TokenCache, TokenStore

logger = Logger()
_cache: list[TokenCache] = []


def use_token_store(store: TokenStore) -> None:
    """Look tokens up in ``store`` (the local stack's composition root sets its own)."""
    _cache[:] = [TokenCache(store)]


def cache() -> TokenCache:
    if not _cache:
        _cache.append(
            TokenCache(
                open_token_store(os.environ.get(STORE_URL_ENV) or f"dynamodb://{os.environ['TOKENS_TABLE']}")
            )
        )
    return _cache[0]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    token = bearer_token((event.get("headers") or {}).get("authorization"))
    if token is None:
        return {"isAuthorized": True, "context": {"project": "", "reason": "missing"}}
    record = cache().lookup(token)
    if record is None or record.revoked:
        return {
            "isAuthorized": True,
            "context": {"project": "", "reason": "revoked" if record else "unknown"},
        }
    return {"isAuthorized": True, "context": {"project": record.project, "token_id": record.token_id}}
