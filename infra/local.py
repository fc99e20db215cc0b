"""The local stack: the deployed API on this machine, wired from ``template.yaml`` (through ``wiring.json``).

HTTP requests on 127.0.0.1 become API Gateway HTTP API (payload 2.0) events for the same handlers the
template deploys, behind the same authorizer. Each function runs in worker processes of its own, one
invocation at a time per process as in a Lambda environment, so requests are served concurrently and a
long summary never holds up ingest.

The store is SQLite in the data directory (``shared.store.sqlite``; default ``.instantml/local``),
locked by the running stack, durable across restarts and crashes; a rollup worker follows its change
feed as the rollup function follows the table's stream on AWS. With ``dynamodb_endpoint`` the same
functions use DynamoDB there instead (DynamoDB Local, or AWS), the template's tables are created when
missing, and the table's stream is polled as Lambda's event source mapping does (records delivered as
soon as they are read, without ``MaximumBatchingWindowInSeconds``). Nothing here knows a route, a table
key or a trigger of its own.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from infra import wiring
from instantml.routes import path_pattern

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


class Router:
    """Matches a method and path to a template route and calls its authorizer, then its function.

    The authorizer runs in this process (a cached token lookup); each function runs in its own pool of
    worker processes (``FunctionWorkers``), so a long summary never holds up ingest.
    """

    def __init__(
        self, routes: list[wiring.Route], authorizers: dict[str, Handler], workers: dict[str, Any]
    ) -> None:
        self._table = [(route, path_pattern(route.path)) for route in routes]
        self._authorizers = authorizers
        self._workers = workers

    def match(self, method: str, path: str) -> tuple[wiring.Route, dict[str, str]] | None:
        for route, pattern in self._table:
            found = pattern.match(path)
            if found and route.method == method:
                return route, found.groupdict()
        return None

    def call(self, route: wiring.Route, event: dict[str, Any]) -> dict[str, Any]:
        if route.authorizer is not None:
            # As API Gateway does for a Lambda authorizer with simple responses (payload 2.0), but for
            # its verdict cache (template.yaml: AuthorizerCacheSeconds), which the local stack leaves
            # out: a lookup costs microseconds here, a revocation counts from the next request, and a
            # request without an Authorization header gets the contract's 401 (functions/authorizer).
            request = {
                **event,
                "type": "REQUEST",
                "routeArn": f"arn:aws:execute-api:local:0:local/$default/{route.method}{event['rawPath']}",
                "identitySource": [],
            }
            verdict = self._authorizers[route.authorizer](request, LambdaContext(route.authorizer))
            if not verdict.get("isAuthorized"):
                return {
                    "statusCode": 403,
                    "headers": {"content-type": "application/json"},
                    "body": '{"message":"Forbidden"}',
                }
            event["requestContext"]["authorizer"] = {"lambda": verdict.get("context", {})}
        result: dict[str, Any] = self._workers[route.function].invoke(event)
        return result


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return status, {"content-type": "application/json"}, body


#: Connections the kernel may queue before the stack accepts them: 512 ranks' uploaders (each request
#: is a connection of its own) connecting at once fit four times over. Linux caps it at
#: ``net.core.somaxconn`` (4096 by default since 5.4; 128 before): ``listen_backlog`` says what holds.
LISTEN_BACKLOG = 4096
#: A kept-alive connection waits this long for its next request before the stack closes it.
IDLE_TIMEOUT_S = 120.0
#: A request's line, headers and body must all arrive within this long of its first byte (else 408 and
#: the connection is closed): a client that stalls, or sends a byte at a time, holds a thread no longer.
REQUEST_READ_TIMEOUT_S = 30.0
#: The request line and headers together (API Gateway allows 10 KiB; browsers on 127.0.0.1 may carry
#: other local apps' cookies). 431 beyond; the standard library also refuses more than 100 headers.
MAX_HEAD_BYTES = 64 * 1024
#: How long a refused request's unread body is drained so that the client reads the answer rather than a
#: reset (closing a socket with unread data resets it).
DRAIN_S = 2.0
_READ_BUFFER = io.DEFAULT_BUFFER_SIZE
_DIGITS = re.compile(r"[0-9]+")


class _ReadRefused(Exception):
    """The request cannot be read: answered with ``status`` and the connection closed."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class _IdleClosed(Exception):
    """A kept-alive connection sent nothing for ``IDLE_TIMEOUT_S``: closed without an answer."""


class _BoundedSocketReader(io.RawIOBase):
    """A connection's reads, each bounded in time (and the request's head in size).

    Waiting for a request, a read waits up to the idle timeout; once a request's first byte is in, the
    whole request must arrive by its deadline. Every ``recv`` gets the time left as its timeout.
    """

    def __init__(self, sock: socket.socket, idle_s: float, request_s: float) -> None:
        self._sock, self._idle_s, self._request_s = sock, idle_s, request_s
        self._deadline: float | None = None
        self._head_bytes: int | None = 0  # None once the head is read

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        self._deadline, self._head_bytes = None, 0

    def head_done(self) -> None:
        self._head_bytes = None

    def readinto(self, buffer: Any) -> int:
        if self._deadline is None:
            self._sock.settimeout(self._idle_s)
        else:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise self._late()
            self._sock.settimeout(left)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            if self._deadline is None:
                raise _IdleClosed from None
            raise self._late() from None
        if n and self._deadline is None:
            self._deadline = time.monotonic() + self._request_s
        if self._head_bytes is not None:
            self._head_bytes += n
            if self._head_bytes > MAX_HEAD_BYTES + len(buffer):
                raise _ReadRefused(
                    431,
                    "headers_too_large",
                    f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes",
                )
        return n

    def _late(self) -> _ReadRefused:
        return _ReadRefused(
            408, "request_timeout", f"the request did not arrive whole within {self._request_s:g} s"
        )


class _RequestHandler(BaseHTTPRequestHandler):
    """The HTTP front: framing checked and every read bounded here, then API Gateway's event."""

    router: Router
    idle_timeout_s = IDLE_TIMEOUT_S
    request_timeout_s = REQUEST_READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body would wait for the client's
    # delayed ACK of the headers (about 40 ms on Linux) on every keep-alive request.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self._reader = _BoundedSocketReader(self.connection, self.idle_timeout_s, self.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader, _READ_BUFFER)

    def handle_one_request(self) -> None:
        """The standard library's, with bounded reads and every method handed to the router (which
        answers one it has no route for 404 not_found, as HTTP API does)."""
        self._reader.next_request()
        # Until the request line is parsed (the standard library's refusals read them).
        self.command, self.requestline, self.request_version = "", "", "HTTP/1.1"
        try:
            self.raw_requestline = self.rfile.readline(MAX_HEAD_BYTES + 1)
            if not self.raw_requestline:
                self.close_connection = True
                return
            if len(self.raw_requestline) > MAX_HEAD_BYTES:
                self.send_error(414)
                return
            if not self.parse_request():  # answered (send_error) already
                return
            self._reader.head_done()
            self._serve()
            self.wfile.flush()
        except _IdleClosed:
            self.close_connection = True
        except _ReadRefused as exc:
            # A late request is not drained: its client is the one that stalled.
            self._answer(*_error(exc.status, exc.code, str(exc)), close=True, drain=exc.status != 408)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            # A write that timed out, or a client that went away before the answer (what the load
            # test's lost answers do); the request was handled, as API Gateway would have handled it.
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's refusals (a malformed request line, too many headers, ...) in the
        contract's error shape rather than HTML."""
        codes = {400: "invalid_request", 414: "uri_too_long", 431: "headers_too_large"}
        text = message or f"the request is malformed ({code} {self.responses.get(code, ('',))[0]})"
        if self.request_version == "HTTP/0.9":  # answered as HTTP/1.1: 0.9 has no status line
            self.request_version = "HTTP/1.1"
        self._answer(*_error(code, codes.get(code, "invalid_request"), text), close=True, drain=True)

    def _content_length(self) -> int:
        """The body's length from its framing; refuses what is not one plain length."""
        if "transfer-encoding" in self.headers:
            raise _ReadRefused(
                411,
                "length_required",
                "the local stack does not take a Transfer-Encoding (chunked bodies); send the body with "
                "a Content-Length",
            )
        values = {v.strip() for v in self.headers.get_all("content-length") or []}
        if not values:
            return 0
        value = values.pop()
        if values or not _DIGITS.fullmatch(value):
            raise _ReadRefused(
                400, "invalid_request", "Content-Length must be one non-negative decimal integer"
            )
        # Any length of more digits than a 10 MiB one is too large (int() of thousands refuses).
        return int(value) if len(value) <= 18 else MAX_REQUEST_BYTES + 1

    def _serve(self) -> None:
        split = urlsplit(self.path)
        try:
            length = self._content_length()
        except _ReadRefused as exc:
            self._answer(*_error(exc.status, exc.code, str(exc)), close=True)
            return
        if length > MAX_REQUEST_BYTES:
            message = "the request body is larger than 10 MiB"
            self._answer(*_error(413, "payload_too_large", message), close=True)
            return
        raw = self.rfile.read(length) if length else b""
        if len(raw) < length:  # the client closed its side before the whole body
            message = f"the body ended after {len(raw)} of its {length} bytes (Content-Length)"
            self._answer(*_error(400, "invalid_request", message), close=True)
            return
        self._answer(*self._dispatch(split.path, split.query, raw))

    def _answer(
        self, status: int, headers: dict[str, str], body: bytes, close: bool = False, drain: bool = True
    ) -> None:
        """Send an answer; with ``close``, the connection's last (what the client still sends is
        drained first, unless ``drain`` is false)."""
        # Writes wait at most the idle timeout (a client that stops reading its answer).
        self.connection.settimeout(self.idle_timeout_s)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if close:
            self.send_header("connection", "close")
            self.close_connection = True
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        if close and drain:
            self.wfile.flush()
            self._drain()

    def _drain(self) -> None:
        """Read and drop what the client still sends, for ``DRAIN_S`` at most, after answering: a socket
        closed with unread data is reset, and the client would see the reset rather than the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + DRAIN_S
            scratch = bytearray(_READ_BUFFER)
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv_into(scratch):
                    return
        except OSError:
            return

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

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # the handlers log through Powertools; request lines would only repeat them

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class _Server(ThreadingHTTPServer):
    """A thread per connection, a listen backlog for a crowd of uploaders, quiet about clients that
    go away."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a connection reset or closed by its client: nothing to report
        super().handle_error(request, client_address)


def listen_backlog() -> tuple[int, int | None]:
    """(the backlog the stack asks for, the kernel's cap on it: ``net.core.somaxconn``, None when
    unknown)."""
    try:
        cap = int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return LISTEN_BACKLOG, None
    return LISTEN_BACKLOG, cap


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

    def __init__(self, source: wiring.StreamSource, table_name: str, function: Any, endpoint: str) -> None:
        """``function`` runs the template's function (``FunctionWorkers``); ``endpoint``: DynamoDB's URL."""
        self.source = source
        self._function = function
        self._streams = streams_client(endpoint)
        self._arn = dynamodb_client(endpoint).describe_table(TableName=table_name)["Table"]["LatestStreamArn"]
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
                self._function.invoke({"Records": batch})
            except Exception:  # noqa: BLE001 - as Lambda does: report, then retry the batch
                traceback.print_exc()
                self._stop.wait(1.0)
                continue
            pending = []
            self.batches += 1


def streams_client(endpoint: str | None = None) -> Any:
    """A DynamoDB Streams client at the table's endpoint (DynamoDB Local and moto answer both APIs
    there), with no account-based endpoint, which botocore would otherwise build from a stream ARN's
    account."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "dynamodbstreams",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_DYNAMODB"),
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=Config(account_id_endpoint_mode="disabled"),
    )


def dynamodb_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "dynamodb", endpoint_url=endpoint, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
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


DEFAULT_DATA_DIR = ".instantml/local"
DATABASE_FILE = "instantml.db"
#: Worker processes per function: ingest and summaries each have their own, so neither waits for the
#: other; two of each keep both cores busy under load.
WORKERS = {"IngestFunction": 2, "SummarizeFunction": 2}
DEFAULT_WORKERS = 1
#: The change feed that rolls up the local database's blocks, as the stream does on AWS.
FEED_NAME = "rollups"
FEED_BATCH = 10_000


#: How often ``instantml local`` runs the watch (the template's schedule says once a minute; locally a
#: shorter round costs little and finds a stopped rank sooner). ``--watch-interval`` sets it.
WATCH_INTERVAL_S = 10.0
#: How often the delivery worker looks for alerts due (a new alert waits at most this long).
DELIVER_POLL_S = 0.5
#: The watch's worker runs at this lower CPU priority (``os.nice``), so that a round never holds up ingest.
WATCH_NICE = 10
DELIVER_THREADS = 4


#: How long the integrity check at start may take before the stack serves (the rest runs behind).
INTEGRITY_BUDGET_S = 1.0


def damaged(path: Path, problem: str) -> str:
    """What a person reads about a damaged database, and what to do."""
    near = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
    files = " ".join(str(f) for f in (path, *near) if f.exists())
    return (
        f"the database {path} is damaged: {problem}. Stop every `instantml local` on "
        f"{path.parent}, then either move the damaged files aside (e.g. `mkdir {path.parent}/damaged && mv "
        f"{files} {path.parent}/damaged/`) to start with an empty database there, restore the file from a "
        "backup, or start with another --data-dir."
    )


def _check_in_background(path: Path) -> None:
    from shared.store.sqlite import check_database

    problem, _ = check_database(path, 24 * 3600.0)
    if problem is not None:
        print(f"instantml local: {damaged(path, problem)}", file=sys.stderr, flush=True)


class StackError(RuntimeError):
    """The stack cannot start; the message names what (a path, a port) and what to do about it."""


class DataDirInUse(StackError):
    """Another stack serves this data directory."""


def database_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / DATABASE_FILE


def _raise_open_files_limit() -> None:
    """A connection is a file descriptor: lift the soft limit (often 1,024) to the hard one, so that
    thousands of uploaders' connections are accepted rather than refused for want of descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


# Worker processes: each runs one function's handler, one invocation at a time, as a Lambda
# execution environment does (Powertools keeps the request being resolved in a class attribute, so
# one process must never resolve two at once).

_worker_handlers: dict[str, Handler] = {}


def _leave_signals_to_the_stack() -> None:
    """Workers ignore Ctrl-C and SIGTERM: a terminal's Ctrl-C, `timeout` and process managers signal
    the whole process group, and a worker killed mid-request would lose its answer and break the pool
    the stack is stopping (its shutdown then waits forever). The stack stops them itself; if the stack
    is killed outright, ``_exit_with_parent`` ends them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_start(environment: dict[str, str], function: str, dotted: str, parent: int, nice: int) -> None:
    _leave_signals_to_the_stack()
    if nice:
        os.nice(nice)
    os.environ.update(environment)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    _worker_handlers[function] = load_handler(dotted)


def _exit_with_parent(parent: int) -> None:
    """A worker whose stack was killed (SIGKILL leaves no chance to stop it) exits within a second:
    everything it acknowledged is committed, and an orphan would only hold memory."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _worker_invoke(function: str, event: dict[str, Any], timeout_s: float, memory: int) -> dict[str, Any]:
    return _worker_handlers[function](event, LambdaContext(function, memory, timeout_s))


def _worker_ready() -> int:
    return os.getpid()


class FunctionWorkers:
    """A pool of worker processes for one function (spawned: nothing of this process is inherited)."""

    def __init__(
        self, function: str, props: dict[str, Any], environment: dict[str, str], size: int, nice: int = 0
    ) -> None:
        """``nice``: how much lower the workers' CPU priority is than the stack's (background work)."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.function = function
        self._timeout = float(props.get("Timeout", 3))
        self._memory = int(props.get("MemorySize", 128))
        self._pool = ProcessPoolExecutor(
            size,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_start,
            initargs=(environment, function, props["Handler"], os.getpid(), nice),
        )
        self._warm = [self._pool.submit(_worker_ready) for _ in range(size)]

    def wait_ready(self) -> set[int]:
        """The worker pids, once every worker has imported its handler."""
        return {future.result(timeout=120) for future in self._warm}

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        future = self._pool.submit(_worker_invoke, self.function, event, self._timeout, self._memory)
        return future.result()

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _roll_up_feed(database: str, environment: dict[str, str], stop: Any, parent: int) -> None:
    """The rollup worker of the SQLite stack: reads the database's change feed from where it left off
    and rolls the touched runs' blocks up with the rollup function's own logic (``shared.rolling``).
    Its position is saved after each batch, so a restart resumes; a batch read twice after a crash is
    rolled up again, which changes nothing."""
    _leave_signals_to_the_stack()
    os.environ.update(environment)
    from shared.rolling import roll_up, touched_steps
    from shared.store.sqlite import SqliteStore

    store = SqliteStore(database)
    position = store.feed_position(FEED_NAME)
    while not stop.is_set() and os.getppid() == parent:
        try:
            changes, after = store.read_changes(position, FEED_BATCH)
            if not changes:
                stop.wait(0.2)
                continue
            for (project, run_id), steps in sorted(touched_steps(changes).items()):
                roll_up(store, project, run_id, steps)
            store.save_feed_position(FEED_NAME, after)
            position = after
        except Exception:  # noqa: BLE001 - a feed that dies would stop rollups silently: report, retry
            traceback.print_exc()
            stop.wait(1.0)


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


class Schedule:
    """Invokes a function every ``every_s`` seconds, as EventBridge does, one round at a time (a round
    that runs long delays the next instead of overlapping it)."""

    def __init__(self, source: wiring.ScheduleSource, workers: FunctionWorkers, every_s: float) -> None:
        self.source, self.workers, self.every_s = source, workers, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"schedule-{source.function}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.workers.invoke(scheduled_event(self.source, time.time()))
            except Exception:  # noqa: BLE001 - a round that failed is reported; the next one runs
                if self._stop.is_set():
                    return
                traceback.print_exc()


def _deliver_alerts(database: str, stop: Any, parent: int) -> None:
    """The local stack's delivery worker: sends the alerts the watch queued in the database (its
    outbox), retrying with backoff (``shared.alerts``); what is queued survives a restart."""
    _leave_signals_to_the_stack()
    from shared.alerts import deliver_due
    from shared.store.sqlite import SqliteStore
    from shared.webhooks import send

    store = SqliteStore(database)
    while not stop.is_set() and os.getppid() == parent:
        try:
            if not deliver_due(store, time.time(), send, DELIVER_THREADS):
                stop.wait(DELIVER_POLL_S)
        except Exception:  # noqa: BLE001 - a worker that dies would stop alerts silently: report, retry
            traceback.print_exc()
            stop.wait(1.0)


class LocalStack:
    """The template's routes and functions on loopback, over the SQLite store in ``data_dir`` (or over
    a DynamoDB endpoint with ``dynamodb_endpoint``)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8787,
        token: str | None = None,
        data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
        dynamodb_endpoint: str | None = None,
        environment: dict[str, str] | None = None,
        watch_interval: float | None = None,
        request_timeout_s: float = REQUEST_READ_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        """``environment`` adds variables to every function's (as a deployment's parameters would);
        ``watch_interval`` is how often scheduled functions run (default ``WATCH_INTERVAL_S``);
        ``request_timeout_s`` bounds the reading of one request, ``idle_timeout_s`` a kept-alive
        connection's wait for the next."""
        self.watch_interval = WATCH_INTERVAL_S if watch_interval is None else watch_interval
        self.host, self.port = host, port
        self._timeouts = {"request_timeout_s": request_timeout_s, "idle_timeout_s": idle_timeout_s}
        self.notes: list[str] = []  # what a person should know about the data found at start
        self.data_dir = Path(data_dir).resolve()
        self.dynamodb_endpoint = dynamodb_endpoint
        self._token = token
        self._extra_environment = environment or {}
        self._lock_file: Any = None
        self._server: ThreadingHTTPServer | None = None
        self._workers: dict[str, FunctionWorkers] = {}
        self._feed: Any = None
        self._feed_stop: Any = None
        self._deliver: Any = None
        self.pollers: list[StreamPoller] = []
        self.schedules: list[Schedule] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def token(self) -> str:
        assert self._token is not None, "the stack is not started"
        return self._token

    @property
    def store_url(self) -> str:
        from shared.store import sqlite_url

        return sqlite_url(database_path(self.data_dir))

    def store(self) -> Any:
        """A store on this stack's data (for tests and tools in this process)."""
        from shared.store import open_store

        if self.dynamodb_endpoint:
            from shared.store.dynamodb import DynamoStore

            return DynamoStore("MetricsTable", dynamodb_client(self.dynamodb_endpoint), "RunsTable")
        return open_store(self.store_url)

    def start(self) -> LocalStack:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalStack:
        environment = self._environment()  # the functions' (this process's own is left alone)
        tokens = self._open_tokens()
        if self._token is None:
            self._token = self._saved_token()
        from shared.tokens import ANY_PROJECT

        if tokens.lookup(self._token) is None:
            # The one token this stack prints grants every project (contract 2: `instantml local`).
            tokens.create(ANY_PROJECT, "instantml local", token=self._token)
        functions = wiring.functions()
        routes = wiring.routes()
        # Bound before any worker starts, so that a port in use is said at once. The router reaches the
        # authorizers and workers made below through these same dicts.
        authorizers: dict[str, Handler] = {}
        router = Router(routes, authorizers, self._workers)
        handler = type("Handler", (_RequestHandler,), {"router": router, **self._timeouts})
        self._server = self._bind(handler)
        self.port = self._server.server_address[1]
        for name in sorted({r.function for r in routes}):
            self._workers[name] = FunctionWorkers(
                name, functions[name], environment, WORKERS.get(name, DEFAULT_WORKERS)
            )
        # The authorizer runs here, in the request's thread (a cached lookup), on this stack's tokens.
        for name in {r.authorizer for r in routes if r.authorizer}:
            module = load_module(functions[name]["Handler"], fresh=True)
            module.use_token_store(tokens)
            authorizers[name] = module.lambda_handler
        if self.dynamodb_endpoint:
            for source in wiring.stream_sources():
                workers = FunctionWorkers(source.function, functions[source.function], environment, 1)
                self._workers[source.function] = workers
                poller = StreamPoller(source, source.table, workers, self.dynamodb_endpoint)
                poller.start()
                self.pollers.append(poller)
        else:
            import multiprocessing

            context = multiprocessing.get_context("spawn")
            self._feed_stop = context.Event()
            self._feed = context.Process(
                target=_roll_up_feed,
                args=(str(database_path(self.data_dir)), environment, self._feed_stop, os.getpid()),
                name="instantml-rollups",
                daemon=True,
            )
            self._feed.start()
            self._deliver = context.Process(
                target=_deliver_alerts,
                args=(str(database_path(self.data_dir)), self._feed_stop, os.getpid()),
                name="instantml-alerts",
                daemon=True,
            )
            self._deliver.start()
            # The watch's alerts wait in the SQLite outbox (an SQS queue on AWS).
            from shared.store import PUBLIC_URL_ENV

            scheduled = {
                **environment,
                PUBLIC_URL_ENV: self.url,
                "WATCH_INTERVAL_S": f"{self.watch_interval:g}",
            }
            scheduled.update(self._extra_environment)  # what the caller sets wins, as for every function
            for timed in wiring.schedule_sources():
                # A round is background work: on a busy machine, ingest and summaries go first.
                workers = FunctionWorkers(timed.function, functions[timed.function], scheduled, 1, WATCH_NICE)
                self._workers[timed.function] = workers
                schedule = Schedule(timed, workers, self.watch_interval)
                schedule.start()
                self.schedules.append(schedule)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="http").start()
        return self

    def _bind(self, handler: type[_RequestHandler]) -> _Server:
        """The listening socket on ``host:port``, or a ``StackError`` that says what to do."""
        import errno

        _raise_open_files_limit()
        where = f"{self.host}:{self.port}"
        try:
            return _Server((self.host, self.port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = f"port {self.port} on {self.host} is in use by another program"
                fix = "stop that program, or pass another --port (--port 0 picks a free one)"
            elif exc.errno == errno.EACCES:
                why = f"this user may not listen on {where} (ports below 1024 need privileges)"
                fix = "pass a --port of 1024 or above"
            elif exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
                why = f"{self.host} is not an address of this machine ({exc.strerror or exc})"
                fix = "pass a --host of this machine, such as 127.0.0.1"
            else:
                why = f"cannot listen on {where} ({exc.strerror or exc})"
                fix = "pass another --host or --port"
            raise StackError(f"{why}; {fix}") from None

    def wait_ready(self) -> LocalStack:
        """Block until every worker process has imported its function (requests are served before, and
        wait for their worker)."""
        for workers in self._workers.values():
            workers.wait_ready()
        return self

    def _environment(self) -> dict[str, str]:
        """What every function sees: the template's environment, and where the store is."""
        environment: dict[str, str] = {}
        # Tables by their logical ids; no queue here (the watch's outbox is the SQLite database).
        refs = {name: name for name in wiring.tables()} | dict.fromkeys(wiring.queues(), "")
        for function in sorted(wiring.functions()):
            for name, value in wiring.environment(function, refs).items():
                if environment.setdefault(name, value) != value:
                    raise RuntimeError(
                        f"functions disagree on {name}; the local stack gives them one environment"
                    )
        if not os.environ.get("INSTANTML_LOCAL_LOGS"):
            # No CloudWatch here: EMF documents and per-request log lines would only bury the output
            # of `instantml local` and the demo. INSTANTML_LOCAL_LOGS=1 keeps them as deployed.
            environment.update(POWERTOOLS_METRICS_DISABLED="true", POWERTOOLS_LOG_LEVEL="WARNING")
        if self.dynamodb_endpoint:
            environment.update(
                AWS_ENDPOINT_URL_DYNAMODB=self.dynamodb_endpoint,
                AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "local"),
                AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "local"),
            )
        else:
            from shared.store import STORE_URL_ENV

            environment[STORE_URL_ENV] = self.store_url
        if self.dynamodb_endpoint:
            from shared.store import STORE_URL_ENV

            environment[STORE_URL_ENV] = ""  # the template's tables, whatever this shell says
        environment.update(self._extra_environment)
        return environment

    def _open_tokens(self) -> Any:
        from shared.store import open_token_store

        if self.dynamodb_endpoint:
            from shared.store.dynamodb import DynamoTokenStore

            self._create_tables()
            return DynamoTokenStore("TokensTable", dynamodb_client(self.dynamodb_endpoint))
        self._lock_data_dir()
        self._check_database()
        return open_token_store(self.store_url)

    def _lock_data_dir(self) -> None:
        """Hold an exclusive lock on ``DIR/lock`` while serving: a second stack exits at once. A data
        directory that cannot be made or written is a ``StackError`` naming it."""
        import fcntl

        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StackError(
                f"cannot make the data directory {self.data_dir} ({exc.strerror or exc}); "
                "pass a --data-dir this user can write to"
            ) from None
        try:
            lock = open(self.data_dir / "lock", "a+")  # noqa: SIM115 - held until stop()
        except OSError as exc:
            raise StackError(
                f"cannot write in the data directory {self.data_dir} ({exc.strerror or exc}); make it "
                "writable (a read-only disk or mount cannot hold a live stack's data), or pass another "
                "--data-dir"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise DataDirInUse(
                f"the data directory {self.data_dir} is in use by another `instantml local` ({holder}); "
                "stop it, or pass another --data-dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        self._lock_file = lock

    def _check_database(self) -> None:
        """Refuse a database file that cannot be written or is damaged, with what to do; say so when an
        empty file is taken as a new database. A check that outruns ``INTEGRITY_BUDGET_S`` (a large
        database on a cold disk) goes on in the background and reports on stderr."""
        from shared.store.sqlite import check_database

        path = database_path(self.data_dir)
        if not path.exists():
            return
        try:
            os.close(os.open(path, os.O_RDWR))
            problem, complete = check_database(path, INTEGRITY_BUDGET_S)
        except OSError as exc:
            raise StackError(
                f"cannot open the database {path} for writing ({exc.strerror or exc}); make it writable, or "
                "pass another --data-dir"
            ) from None
        if problem is not None:
            raise StackError(damaged(path, problem))
        if path.stat().st_size == 0:
            self.notes.append(
                f"the database {path} was an empty file (0 bytes, no data in it): starting a new database "
                "there. If runs were expected, stop this stack and restore the file from a backup."
            )
        if not complete:
            threading.Thread(target=_check_in_background, args=(path,), daemon=True, name="check").start()

    def _saved_token(self) -> str:
        """The stack's token: the one saved in the data directory, so that it stays the same across
        restarts (users export it), or a new one."""
        if self.dynamodb_endpoint:
            return secrets.token_urlsafe(24)
        path = self.data_dir / "token"
        if path.exists():
            return path.read_text().strip()
        token = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token

    def _create_tables(self) -> None:
        assert self.dynamodb_endpoint is not None
        client = dynamodb_client(self.dynamodb_endpoint)
        existing = set(client.list_tables()["TableNames"])
        for name in wiring.tables():
            if name not in existing:
                client.create_table(TableName=name, **wiring.table_definition(name))

    def stop(self) -> None:
        for schedule in self.schedules:
            schedule.stop()
        self.schedules = []
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for poller in self.pollers:
            poller.stop()
        self.pollers = []
        for workers in self._workers.values():
            workers.stop()
        self._workers = {}
        if self._feed is not None:
            self._feed_stop.set()
            self._feed.join(timeout=30)
            if self._feed.is_alive():
                self._feed.terminate()
            self._feed = None
        if self._deliver is not None:
            self._deliver.join(timeout=30)
            if self._deliver.is_alive():
                self._deliver.terminate()
            self._deliver = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signed(url: str, token: str | None) -> str:
    """A printed page link, with the token in its fragment when given: never sent to a server, and the page
    takes it out of the address bar at once into the browser's storage for this origin, so the link
    signs the browser in once and every page opened from it after needs no token."""
    return f"{url}#token={token}" if token else url


def view_url(base_url: str, project: str, run_id: str, token: str | None = None) -> str:
    """The Distributed tab of a run."""
    from instantml import routes

    return _signed(f"{base_url}{routes.DISTRIBUTED_VIEW.format(project=project, run_id=run_id)}", token)


def runs_url(base_url: str, project: str, token: str | None = None) -> str:
    """The runs page of a project."""
    from instantml import routes

    return _signed(f"{base_url}{routes.RUNS_VIEW.format(project=project)}", token)


def run_url(base_url: str, project: str, run_id: str, token: str | None = None) -> str:
    """The run page of a run: its config and ``run.log`` charts."""
    from instantml import routes

    return _signed(f"{base_url}{routes.RUN_VIEW.format(project=project, run_id=run_id)}", token)


def compare_url(base_url: str, project: str, run_ids: list[str], token: str | None = None) -> str:
    """The comparison of runs: the runs in the fragment."""
    from instantml import routes

    url = f"{base_url}{routes.COMPARE_VIEW.format(project=project)}#runs={','.join(run_ids)}"
    return f"{url}&token={token}" if token else url


def stored_projects(data_dir: str | os.PathLike[str], limit: int = 5) -> tuple[list[tuple[str, int]], int]:
    """The projects a local stack's SQLite database holds, the most recently created run's first, with
    their run counts (at most ``limit``), and how many projects there are: what ``instantml local``
    links to, rather than a placeholder. Read-only, and nothing if the database cannot be read."""
    import sqlite3

    path = database_path(data_dir)
    if not path.exists():
        return [], 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            rows = conn.execute(
                "SELECT project, COUNT(*) FROM runs GROUP BY project ORDER BY MAX(id) DESC"
            ).fetchall()
    except sqlite3.Error:
        return [], 0
    return [(str(p), int(n)) for p, n in rows[:limit]], len(rows)


def main(
    host: str,
    port: int,
    token: str | None,
    data_dir: str = DEFAULT_DATA_DIR,
    dynamodb_endpoint: str | None = None,
    watch_interval: float | None = None,
) -> int:
    import signal

    def stop_on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    try:
        stack = LocalStack(
            host, port, token, data_dir, dynamodb_endpoint, watch_interval=watch_interval
        ).start()
    except StackError as exc:
        print(f"instantml local: {exc}", file=sys.stderr)
        return 2
    for note in stack.notes:
        print(f"instantml local: {note}", file=sys.stderr)
    requested, cap = listen_backlog()
    if cap is not None and cap < requested:
        print(
            f"instantml local: the kernel caps the listen backlog at {cap} (net.core.somaxconn), below the "
            f"{requested} asked for: a crowd of uploaders connecting at once may wait or be refused; "
            f"`sysctl -w net.core.somaxconn={requested}` raises it",
            file=sys.stderr,
        )
    try:
        where = dynamodb_endpoint or f"{database_path(stack.data_dir)}"
        print(f"InstantML local API on {stack.url}")
        print(f"  data: {where}")
        print(f"  export INSTANTML_API_URL={stack.url}")
        print(f"  export INSTANTML_API_KEY={stack.token}")
        projects, total = ([], 0) if dynamodb_endpoint else stored_projects(stack.data_dir)
        if projects:
            more = f" (and {total - len(projects)} more)" if total > len(projects) else ""
            print(f"  Runs pages of the {total} project(s) stored here{more}:")
            for i, (name, runs) in enumerate(projects):  # the first link signs the browser in
                link = runs_url(stack.url, name, stack.token if i == 0 else None)
                print(f"    {name} ({runs} run(s)): {link}")
        else:
            link = runs_url(stack.url, "PROJECT", stack.token)
            print(f"  Runs page: {link} (PROJECT: the project of your im.init(project=...))")
        print(f"  Distributed tab: {view_url(stack.url, 'PROJECT', 'RUN_ID')}")
        saved = stack.data_dir / "token"  # only a token the stack made is kept there (not --token's)
        kept = not dynamodb_endpoint and saved.exists() and saved.read_text().strip() == stack.token
        print(f"  The token, for the pages' sign-in: {stack.token}" + (f" (kept in {saved})" if kept else ""))
        option = (
            f"--endpoint-url {dynamodb_endpoint} --table TokensTable"
            if dynamodb_endpoint
            else (f"--data-dir {stack.data_dir}")
        )
        print(f"  Per-project tokens: instantml tokens {option} create --project PROJECT")
        if stack.schedules:
            print(
                f"  Watching live runs every {stack.watch_interval:g} s; alerts: instantml alerts --project "
                "PROJECT --webhook URL"
            )
        print("Ctrl-C stops it.", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        # A repeated SIGTERM must not cut the stop short (`timeout` and process managers send it to the
        # process and then to its group): the workers finish the requests they hold. A second Ctrl-C is
        # a person who will not wait: exit at once (what was acknowledged is committed already).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
        stack.stop()
    return 0
