"""The HTTP front of the local stack: requests on 127.0.0.1 become API Gateway HTTP API events for the
routes of ``template.yaml``, behind the same authorizer, with API Gateway's limits (payload size, head
size, idle and read timeouts)."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infra import wiring
from infra.local.events import ARN_PREFIX, Handler, LambdaContext, http_api_event
from instantml.routes import path_pattern
from shared.errors import SECURITY_HEADERS

MAX_REQUEST_BYTES = 10 * 1024 * 1024  # API Gateway HTTP API's payload limit


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
            verdict = self._authorizers[route.authorizer](
                request, LambdaContext(route.authorizer, ARN_PREFIX + route.authorizer)
            )
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


class RequestHandler(BaseHTTPRequestHandler):
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
        sent = {name.lower() for name in headers}
        # What the functions set on their answers (functions/api.py), on the stack's own too (its 401s,
        # 408s, 413s): never sniffed, no Referer.
        for name, value in {**SECURITY_HEADERS, **headers}.items():
            if name in headers or name.lower() not in sent:
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


class Server(ThreadingHTTPServer):
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
