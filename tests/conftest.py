"""Shared fixtures: a moto table built from the template, real API Gateway v2 events, the local stack."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EVENTS = ROOT / "events"
TOKEN = "sample-token"  # events/authorizer_request.json presents it


def _share_botocore_models() -> None:
    """One botocore data loader (the JSON models, endpoint rules and partitions, with its caches) for
    the whole test run.

    moto gives every mock a fresh default boto3 session, and each fresh session lists botocore's data
    directories and parses the DynamoDB model and the endpoint rules again: tens of thousands of
    ``stat`` calls and about 0.2 s for each test that makes a table. botocore treats what it loads as
    read-only (one session already shares it between its clients).
    """
    import functools

    try:
        import botocore.session
    except ImportError:  # the client's venv (make client-tests) has no AWS packages
        return
    botocore.session.create_loader = functools.cache(botocore.session.create_loader)


_share_botocore_models()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real AWS: fake credentials, a region, and no endpoint override left over from elsewhere."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL_DYNAMODB", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def metrics_table(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The template's tables in moto, the template's environment for the functions, and one token.

    ``TOKEN`` grants project ``distributed-job`` (the project of events/*.json).
    """
    import boto3
    from moto import mock_aws

    from infra import template
    from shared.store.dynamodb import DynamoTokenStore

    refs = {name: f"test-{name.removesuffix('Table').lower()}" for name in template.tables()}
    with mock_aws():
        for logical_id, name in refs.items():
            boto3.client("dynamodb").create_table(TableName=name, **template.table_definition(logical_id))
        for logical_id in template.queues():  # a Ref to a queue is its URL
            refs[logical_id] = boto3.client("sqs").create_queue(QueueName=f"test-{logical_id.lower()}")[
                "QueueUrl"
            ]
        for function in template.functions():
            for name, value in template.environment(function, refs).items():
                monkeypatch.setenv(name, value)
        DynamoTokenStore("test-tokens").create("distributed-job", "tests", token=TOKEN)
        yield "test-metrics"


@pytest.fixture
def handlers(metrics_table: str) -> Iterator[dict[str, Any]]:
    """The functions' handlers, freshly imported inside the moto mock (their store is created lazily)."""
    import importlib
    import sys

    from infra import template

    loaded, modules = {}, []
    for name, props in template.functions().items():
        module_name, _, attr = props["Handler"].rpartition(".")
        sys.modules.pop(module_name, None)
        modules.append(module_name)
        loaded[name] = getattr(importlib.import_module(module_name), attr)
    yield loaded
    for module_name in modules:  # their stores point into this test's moto: never reuse them
        sys.modules.pop(module_name, None)


def load_event(name: str) -> dict[str, Any]:
    return copy.deepcopy(json.loads((EVENTS / name).read_text()))


def with_body(event: dict[str, Any], body: Any, **headers: str) -> dict[str, Any]:
    """A copy of a sample event with another JSON (or raw string) body and extra headers."""
    event = copy.deepcopy(event)
    event["body"] = body if isinstance(body, str) else json.dumps(body)
    event["isBase64Encoded"] = False
    event["headers"].update({k.replace("_", "-").lower(): v for k, v in headers.items()})
    return event


class Context:
    function_name = "test"
    memory_limit_in_mb = 1024
    invoked_function_arn = "arn:aws:lambda:us-east-1:000000000000:function:test"
    aws_request_id = "req-1"


def call(handler: Any, event: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    response = handler(event, Context())
    body = response.get("body") or ""
    headers = {k.lower(): v for k, v in (response.get("headers") or {}).items()}
    parsed = json.loads(body) if headers.get("content-type", "").startswith("application/json") else body
    return response["statusCode"], headers, parsed


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real local stack on a free loopback port, on SQLite in a temporary data directory (template
    wiring, worker processes, the rollup feed)."""
    from infra.local import LocalStack

    saved = dict(os.environ)
    stack = LocalStack(port=0, data_dir=tmp_path_factory.mktemp("stack")).start()
    try:
        yield stack
    finally:
        stack.stop()
        os.environ.clear()
        os.environ.update(saved)
