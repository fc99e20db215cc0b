"""Tokens and tenant isolation (contract 3.1): the authorizer, the functions' check, and over HTTP."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import TOKEN, call, load_event

GET = "get_distributed.json"
POST = "post_rank_metrics.json"


def verdict(event: dict[str, Any], context: dict[str, str] | None) -> dict[str, Any]:
    if context is None:
        event["requestContext"].pop("authorizer", None)
    else:
        event["requestContext"]["authorizer"] = {"lambda": context}
    return event


def test_the_authorizer_maps_a_token_to_its_project(handlers: dict[str, Any]) -> None:
    authorizer = handlers["AuthorizerFunction"]
    event = load_event("authorizer_request.json")
    assert authorizer(event, None) == {
        "isAuthorized": True,
        "context": {"project": "distributed-job", "token_id": authorizer(event, None)["context"]["token_id"]},
    }
    for header, reason in ((None, "missing"), ("Bearer nope", "unknown"), ("Token " + TOKEN, "missing")):
        event = load_event("authorizer_request.json")
        event["headers"].pop("authorization")
        if header:
            event["headers"]["authorization"] = header
        assert authorizer(event, None)["context"] == {"project": "", "reason": reason}


def test_functions_refuse_what_the_authorizer_did_not_grant(handlers: dict[str, Any]) -> None:
    summarize, ingest = handlers["SummarizeFunction"], handlers["IngestFunction"]
    cases = [
        (None, 401, "unauthorized"),
        ({"project": "", "reason": "missing"}, 401, "unauthorized"),
        ({"project": "", "reason": "unknown"}, 401, "unauthorized"),
        ({"project": "other-project"}, 403, "forbidden"),
    ]
    for context, status, code in cases:
        for handler, name in ((summarize, GET), (ingest, POST)):
            got, _, body = call(handler, verdict(load_event(name), context))
            assert (got, body["error"]["code"]) == (status, code), (context, name)
    assert call(summarize, verdict(load_event(GET), {"project": "*"}))[0] == 404  # granted, no events
    assert call(summarize, load_event(GET))[0] == 404  # the sample's own verdict is granted


def test_a_token_in_the_query_string_is_refused(handlers: dict[str, Any]) -> None:
    event = load_event(GET)
    event["queryStringParameters"] = {"token": TOKEN}
    status, _, body = call(handlers["SummarizeFunction"], event)
    assert status == 401
    assert TOKEN not in json.dumps(body)


def test_revocation_takes_effect_when_the_authorizer_cache_expires(metrics_table: str) -> None:
    from shared.store.dynamodb import DynamoTokenStore
    from shared.tokens import TokenCache

    store = DynamoTokenStore("test-tokens")
    token, record = store.create("p", "cached")
    cache = TokenCache(store, ttl=60)
    first = cache.lookup(token, now=0.0)
    assert first is not None
    assert (first.token_id, first.project, first.revoked) == (
        record.token_id,
        "p",
        False,
    )
    store.revoke(record.token_id)
    assert cache.lookup(token, now=59.0) is first  # still cached
    refreshed = cache.lookup(token, now=61.0)
    assert refreshed is not None
    assert refreshed.revoked
    assert not refreshed.grants("p")
