"""What AWS hands a function, made here: API Gateway HTTP API events, stream records as Lambda
delivers them, EventBridge's scheduled events, a Lambda context; and handlers loaded as the runtime
loads them."""

from __future__ import annotations

import base64
import importlib
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any
from urllib.parse import parse_qsl

from infra import wiring

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


#: A local function's ARN is this and its name (``LambdaContext.invoked_function_arn``).
ARN_PREFIX = "arn:aws:lambda:local:000000000000:function:"


@dataclass(frozen=True)
class LambdaContext:
    """The attributes of a Lambda context that Powertools and the handlers read, all plain ones (as the
    runtime's context has): one is made for every request."""

    function_name: str
    invoked_function_arn: str  # ARN_PREFIX + function_name
    memory_limit_in_mb: int = 1024
    timeout_s: float = 29.0
    aws_request_id: str = field(default_factory=partial(secrets.token_hex, 16))
    started: float = field(default_factory=time.monotonic)

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.timeout_s - (time.monotonic() - self.started)) * 1000))


def load_module(dotted: str, fresh: bool = False) -> Any:
    """The module of a ``Handler`` setting (``package.module.function``), imported as the runtime does;
    ``fresh`` imports it anew, as a cold start."""
    if str(wiring.ROOT) not in sys.path:
        sys.path.insert(0, str(wiring.ROOT))
    module = dotted.rpartition(".")[0]
    if fresh:
        sys.modules.pop(module, None)
    return importlib.import_module(module)


def load_handler(dotted: str, fresh: bool = False) -> Handler:
    """``package.module.function`` as the Lambda runtime resolves a ``Handler`` setting.

    ``fresh`` imports the module anew, as a cold start does: nothing cached by an earlier import (such
    as a store client bound to another endpoint) carries over."""
    handler: Handler = getattr(load_module(dotted, fresh), dotted.rpartition(".")[2])
    return handler


def http_api_event(
    method: str,
    route: wiring.Route,
    raw_path: str,
    path_parameters: dict[str, str],
    raw_query: str,
    headers: dict[str, str],
    body: bytes,
    source_ip: str = "127.0.0.1",
) -> dict[str, Any]:
    """An API Gateway HTTP API payload 2.0 event, as API Gateway builds it."""
    query: dict[str, str] = {}
    for name, value in parse_qsl(raw_query, keep_blank_values=True):
        query[name] = f"{query[name]},{value}" if name in query else value
    now = time.time()
    try:
        text, encoded = body.decode("utf-8"), False
    except UnicodeDecodeError:
        text, encoded = base64.b64encode(body).decode(), True
    route_key = f"{route.method} {route.path}"
    event: dict[str, Any] = {
        "version": "2.0",
        "routeKey": route_key,
        "rawPath": raw_path,
        "rawQueryString": raw_query,
        "headers": headers,
        "requestContext": {
            "accountId": "000000000000",
            "apiId": "local",
            "domainName": headers.get("host", "127.0.0.1"),
            "domainPrefix": "local",
            "http": {
                "method": method,
                "path": raw_path,
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": headers.get("user-agent", ""),
            },
            "requestId": uuid.uuid4().hex,
            "routeKey": route_key,
            "stage": "$default",
            "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now)),
            "timeEpoch": int(now * 1000),
        },
        "pathParameters": path_parameters,
        "isBase64Encoded": encoded,
    }
    if query:
        event["queryStringParameters"] = query
    if body:
        event["body"] = text
    return event


def lambda_records(records: list[dict[str, Any]], stream_arn: str) -> list[dict[str, Any]]:
    """``GetRecords`` records as Lambda hands them to a function (epoch times, the stream's ARN)."""
    converted = []
    for record in records:
        dynamodb = dict(record["dynamodb"])
        created = dynamodb.get("ApproximateCreationDateTime")
        if isinstance(created, datetime):
            dynamodb["ApproximateCreationDateTime"] = int(created.timestamp())
        converted.append({**record, "dynamodb": dynamodb, "eventSourceARN": stream_arn})
    return converted


def scheduled_event(source: wiring.ScheduleSource, now: float) -> dict[str, Any]:
    """The EventBridge event a ``Schedule`` trigger delivers (``aws.events``, ``Scheduled Event``)."""
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": "123456789012",
        "time": datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        "resources": [f"arn:aws:events:us-east-1:123456789012:rule/{source.function}-schedule"],
        "detail": {},
    }
