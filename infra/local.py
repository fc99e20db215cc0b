"""The local stack: the deployed API on this machine, wired from ``template.yaml``.

HTTP requests on 127.0.0.1 become API Gateway HTTP API (payload 2.0) events for the same handlers the
template deploys; DynamoDB is moto running as a local endpoint, its table created from the template's
table definition. A table's stream is polled as Lambda's event source mapping does and its records
handed to the function the template names, in the same event shape. Nothing here knows a route, a
table key or a trigger of its own.

One difference from AWS: stream records are delivered as soon as they are read, without waiting for
``MaximumBatchingWindowInSeconds``, so that local runs and tests see rollups promptly.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from infra import template

MAX_REQUEST_BYTES = 10 * 1024 * 1024  # API Gateway HTTP API's payload limit
Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


@dataclass(frozen=True)
class LambdaContext:
    """The attributes of a Lambda context that Powertools and the handlers read."""

    function_name: str
    memory_limit_in_mb: int = 1024
    timeout_s: float = 29.0
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    started: float = field(default_factory=time.monotonic)

    @property
    def invoked_function_arn(self) -> str:
        return f"arn:aws:lambda:local:000000000000:function:{self.function_name}"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.timeout_s - (time.monotonic() - self.started)) * 1000))


def load_handler(dotted: str, fresh: bool = False) -> Handler:
    """``package.module.function`` as the Lambda runtime resolves a ``Handler`` setting.

    ``fresh`` imports the module anew, as a cold start does: nothing cached by an earlier import (such
    as a store client bound to another endpoint) carries over."""
    if str(template.ROOT) not in sys.path:
        sys.path.insert(0, str(template.ROOT))
    module, _, name = dotted.rpartition(".")
    if fresh:
        sys.modules.pop(module, None)
    handler: Handler = getattr(importlib.import_module(module), name)
    return handler


def http_api_event(
    method: str,
    route: template.Route,
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


class Router:
    """Matches a method and path to a template route and calls its authorizer, then its handler."""

    def __init__(self, routes: list[template.Route], functions: dict[str, dict[str, Any]]) -> None:
        self._table = [
            (route, re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(route.path)) + "$"))
            for route in routes
        ]
        # A fresh import per stack, as a cold start: each function's store then creates its DynamoDB
        # client for this stack's endpoint, not for one that an earlier stack in this process had.
        names = {r.function for r in routes} | {r.authorizer for r in routes if r.authorizer}
        self._handlers = {name: load_handler(functions[name]["Handler"], fresh=True) for name in names}
        # One invocation at a time, as in one Lambda execution environment. The HTTP server runs
        # requests in threads, and Powertools keeps the request being resolved in a class attribute
        # (``BaseRouter.current_event``) shared by every resolver in the process: two at once would
        # read each other's bodies and answer each other's requests.
        self._invoke = threading.Lock()

    def match(self, method: str, path: str) -> tuple[template.Route, dict[str, str]] | None:
        for route, pattern in self._table:
            found = pattern.match(path)
            if found and route.method == method:
                return route, found.groupdict()
        return None

    def call(self, route: template.Route, event: dict[str, Any]) -> dict[str, Any]:
        if route.authorizer is not None:
            # As API Gateway does for a Lambda authorizer with simple responses (payload 2.0).
            request = {
                **event,
                "type": "REQUEST",
                "routeArn": f"arn:aws:execute-api:local:0:local/$default/{route.method}{event['rawPath']}",
                "identitySource": [],
            }
            verdict = self._handlers[route.authorizer](request, LambdaContext(route.authorizer))
            if not verdict.get("isAuthorized"):
                return {
                    "statusCode": 403,
                    "headers": {"content-type": "application/json"},
                    "body": '{"message":"Forbidden"}',
                }
            event["requestContext"]["authorizer"] = {"lambda": verdict.get("context", {})}
        with self._invoke:
            return self._handlers[route.function](event, LambdaContext(route.function))


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return status, {"content-type": "application/json"}, body


class _RequestHandler(BaseHTTPRequestHandler):
    router: Router
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        split = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_REQUEST_BYTES:
            self.close_connection = True
            status, headers, body = _error(413, "payload_too_large", "the request body is larger than 10 MiB")
        else:
            raw = self.rfile.read(length) if length else b""
            status, headers, body = self._dispatch(split.path, split.query, raw)
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away before the answer (what the load test's lost answers do); the
            # request was handled, as API Gateway would have handled it.
            self.close_connection = True

    def _dispatch(self, path: str, query: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        found = self.router.match(self.command, path)
        if found is None:
            return _error(404, "not_found", f"there is no route {self.command} {path}")
        route, params = found
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]},{value}" if key in headers else value
        event = http_api_event(self.command, route, path, params, query, headers, raw, self.client_address[0])
        try:
            result = self.router.call(route, event)
        except Exception:  # noqa: BLE001 - as API Gateway answers a function that raised
            traceback.print_exc()
            return 500, {"content-type": "application/json"}, b'{"message":"Internal Server Error"}'

        body = result.get("body") or ""
        payload = base64.b64decode(body) if result.get("isBase64Encoded") else body.encode()
        return int(result.get("statusCode", 200)), dict(result.get("headers") or {}), payload

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the handlers log through Powertools; request lines would only repeat them


def _matches(pattern: dict[str, Any], record: dict[str, Any]) -> bool:
    """An event filter pattern (the subset the template uses: exact values, nested fields)."""
    for name, allowed in pattern.items():
        value = record.get(name)
        if isinstance(allowed, dict):
            if not isinstance(value, dict) or not _matches(allowed, value):
                return False
        elif not isinstance(allowed, list) or any(isinstance(a, dict) for a in allowed):
            raise ValueError(f"the local stack cannot apply the filter {pattern!r}; extend _matches")
        elif value not in allowed:
            return False
    return True


class StreamPoller:
    """Reads a table's stream and invokes a function with its records, as an event source mapping.

    A batch whose function raises is retried (after a pause) until it succeeds or the stack stops.
    """

    def __init__(self, source: template.StreamSource, table_name: str, function: dict[str, Any]) -> None:
        import boto3

        self.source = source
        self._handler = load_handler(function["Handler"], fresh=True)
        self._timeout = float(function.get("Timeout", 3))
        self._memory = int(function.get("MemorySize", 128))
        self._client = boto3.client("dynamodb")
        self._streams = streams_client()
        self._arn = self._client.describe_table(TableName=table_name)["Table"]["LatestStreamArn"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"stream-{source.function}")
        self.batches = 0  # batches handled

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a poller that dies would stop rollups silently
                if self._stop.is_set():
                    return  # the stack is stopping and its tables are going
                traceback.print_exc()
                self._stop.wait(1.0)

    def _poll(self) -> None:
        shard = self._streams.describe_stream(StreamArn=self._arn)["StreamDescription"]["Shards"][0]
        iterator = self._streams.get_shard_iterator(
            StreamArn=self._arn, ShardId=shard["ShardId"], ShardIteratorType=self.source.starting_position
        )["ShardIterator"]
        pending: list[dict[str, Any]] = []
        while not self._stop.is_set():
            while len(pending) < self.source.batch_size:
                page = self._streams.get_records(
                    ShardIterator=iterator, Limit=min(1000, self.source.batch_size - len(pending))
                )
                iterator = page["NextShardIterator"]
                pending += lambda_records(page["Records"], self._arn)
                if not page["Records"]:
                    break
            batch = [
                r
                for r in pending
                if not self.source.filters or any(_matches(f, r) for f in self.source.filters)
            ]
            if not batch:
                pending = []
                self._stop.wait(0.1)
                continue
            try:
                context = LambdaContext(self.source.function, self._memory, self._timeout)
                self._handler({"Records": batch}, context)
            except Exception:  # noqa: BLE001 - as Lambda does: report, then retry the batch
                traceback.print_exc()
                self._stop.wait(1.0)
                continue
            pending = []
            self.batches += 1


def streams_client() -> Any:
    """A DynamoDB Streams client for moto: the table's endpoint (moto answers both APIs there), and
    no account-based endpoint, which botocore would otherwise build from a stream ARN's account."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "dynamodbstreams",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB"),
        config=Config(account_id_endpoint_mode="disabled"),
    )


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


class LocalStack:
    """moto + the template's functions behind an HTTP server, all on loopback."""

    TABLES = ("MetricsTable", "TokensTable")

    def __init__(
        self, host: str = "127.0.0.1", port: int = 8787, token: str | None = None, in_process: bool = False
    ) -> None:
        """``in_process`` runs moto inside this process instead of as a local DynamoDB endpoint: the
        same tables and calls, several times faster (for load tests), but reachable only from here."""
        self.host, self.port = host, port
        self.token = token or secrets.token_urlsafe(24)
        self.in_process = in_process
        self._moto: Any = None
        self._server: ThreadingHTTPServer | None = None
        self.pollers: list[StreamPoller] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def dynamodb_url(self) -> str:
        return os.environ["AWS_ENDPOINT_URL_DYNAMODB"]

    def start(self) -> LocalStack:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per DynamoDB call otherwise
        if self.in_process:
            from moto import mock_aws

            self._moto = mock_aws()
            self._moto.start()
            os.environ.pop("AWS_ENDPOINT_URL_DYNAMODB", None)
        else:
            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._moto.start()
            moto_host, moto_port = self._moto.get_host_and_port()
            os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = f"http://{moto_host}:{moto_port}"
        os.environ.update(
            AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            AWS_ACCESS_KEY_ID="local",
            AWS_SECRET_ACCESS_KEY="local",  # noqa: S106 - moto accepts any credentials
        )
        os.environ.pop("AWS_PROFILE", None)
        self._create_tables()
        refs = {name: name for name in self.TABLES}
        routes = template.routes()
        functions = template.functions()
        environment: dict[str, str] = {}
        for function in sorted(functions):
            for name, value in template.environment(function, refs).items():
                if environment.setdefault(name, value) != value:
                    raise RuntimeError(
                        f"functions disagree on {name}; the local stack runs them in one process"
                    )
        os.environ.update(environment)
        if not os.environ.get("INSTANTML_LOCAL_LOGS"):
            # No CloudWatch here: EMF documents and per-request log lines would only bury the output
            # of `instantml local` and the demo. INSTANTML_LOCAL_LOGS=1 keeps them as deployed.
            os.environ.update(POWERTOOLS_METRICS_DISABLED="true", POWERTOOLS_LOG_LEVEL="WARNING")
        from shared.tokens import ANY_PROJECT, TokenStore

        # The one token this stack prints grants every project (contract 2: `instantml local`).
        TokenStore("TokensTable").create(ANY_PROJECT, "instantml local", token=self.token)
        for source in template.stream_sources():
            poller = StreamPoller(source, refs[source.table], functions[source.function])
            poller.start()
            self.pollers.append(poller)
        handler = type("Handler", (_RequestHandler,), {"router": Router(routes, functions)})
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _create_tables(self) -> None:
        import boto3

        client = boto3.client("dynamodb")
        for name in self.TABLES:
            client.create_table(TableName=name, **template.table_definition(name))

    def stop(self) -> None:
        for poller in self.pollers:
            poller.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._moto is not None:
            # moto keeps its tables in this process's memory, whichever way it ran: drop them so that
            # the next stack in this process starts empty.
            import boto3

            client = boto3.client("dynamodb")
            for name in self.TABLES:
                client.delete_table(TableName=name)
            self._moto.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def view_url(base_url: str, project: str, run_id: str, token: str) -> str:
    from instantml import routes

    path = routes.DISTRIBUTED_VIEW.format(project=project, run_id=run_id)
    return f"{base_url}{path}#token={token}"


def main(host: str, port: int, token: str | None) -> int:
    stack = LocalStack(host, port, token).start()
    print(f"InstantML local API on {stack.url}")
    print(f"  export INSTANTML_API_URL={stack.url}")
    print(f"  export INSTANTML_API_KEY={stack.token}")
    print(f"  Distributed tab: {view_url(stack.url, 'PROJECT', 'RUN_ID', stack.token)}")
    tokens = f"instantml tokens --table TokensTable --endpoint-url {stack.dynamodb_url}"
    print(f"  Per-project tokens: {tokens} create --project PROJECT")
    print("Ctrl-C stops it.", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
    return 0
