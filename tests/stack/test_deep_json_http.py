"""Deeply nested JSON bodies over HTTP to the local stack: 400 in the contract's shape, never a 5xx."""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest

from instantml import limits, routes
from shared.ingest.json_body import MAX_JSON_DEPTH
from tests.functions.test_deep_json import assert_refused_naming_body, deep_bodies

PROJECT = "deep-json"


def request(stack: Any, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    url = urlsplit(stack.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    headers = {"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"}
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 100_000])
@pytest.mark.parametrize("route", [routes.RANK_METRICS, routes.RANK_METRICS_BATCH])
def test_a_deeply_nested_body_is_400_over_http_and_stores_nothing(
    local_stack: Any, route: str, depth: int
) -> None:
    run_id = uuid.uuid4().hex
    path = route.format(project=PROJECT, run_id=run_id)
    for name, body in deep_bodies(depth).items():
        status, answer = request(local_stack, "POST", path, body.encode())
        if route == routes.RANK_METRICS and len(body.encode()) > limits.MAX_EVENT_BYTES:
            assert (status, answer["error"]["code"]) == (413, "payload_too_large"), name
            continue
        assert_refused_naming_body(status, answer)
    summary = routes.DISTRIBUTED.format(project=PROJECT, run_id=run_id)
    status, answer = request(local_stack, "GET", summary)
    assert (status, answer["error"]["code"]) == (404, "not_found")
