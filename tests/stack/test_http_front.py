"""The local stack's HTTP front under hostile framing, over raw sockets (issue 28, item 5).

Bad framing is a 400 in the contract's error shape, a body larger than any route takes a 413 before it is
read, every read is bounded (a stalled or dripping request gets 408, an idle connection is closed), and
thousands of connections are held at once without a reset. The stack here has short bounds (``REQUEST_S``,
``IDLE_S``) so that the tests wait seconds, not the defaults' half-minute; every wait is a socket timeout
on the condition asserted, never a sleep.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from infra.local import LISTEN_BACKLOG, MAX_HEAD_BYTES, MAX_REQUEST_BYTES, LocalStack, listen_backlog

REQUEST_S = 2.0
IDLE_S = 10.0
#: How long past a bound an answer or a close may take on a busy 2-core machine.
SLACK_S = 5.0
CONNECTIONS = 2000
RANK_METRICS = "/v1/projects/p/runs/r/rank-metrics"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    saved = dict(os.environ)
    stack = LocalStack(
        port=0, data_dir=tmp_path_factory.mktemp("front"), request_timeout_s=REQUEST_S, idle_timeout_s=IDLE_S
    ).start()
    try:
        yield stack
    finally:
        stack.stop()
        os.environ.clear()
        os.environ.update(saved)


def connect(stack: LocalStack, timeout: float = 30.0) -> socket.socket:
    s = socket.create_connection((stack.host, stack.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds each read)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def parse(answer: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    parsed = json.loads(body) if headers.get("content-type") == "application/json" else body
    return int(lines[0].split()[1]), headers, parsed


def exchange(stack: LocalStack, data: bytes) -> tuple[int, dict[str, str], Any]:
    with connect(stack) as s:
        s.sendall(data)
        return parse(read_all(s))


def post_head(length: str, extra: str = "") -> bytes:
    return (
        f"POST {RANK_METRICS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer x\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


@pytest.mark.parametrize("length", ["abc", "-1", "+5", "1e3", "0x10", "5, 6", "", "١"])
def test_a_content_length_that_is_not_one_plain_number_is_a_400(stack: LocalStack, length: str) -> None:
    status, headers, body = exchange(stack, post_head(length) + b"{}")
    assert status == 400, body
    assert body["error"]["code"] == "invalid_request" and "Content-Length" in body["error"]["message"]
    assert headers["connection"] == "close"


def test_two_different_content_lengths_are_a_400(stack: LocalStack) -> None:
    status, _, body = exchange(stack, post_head("2", "Content-Length: 3\r\n") + b"{}")
    assert (status, body["error"]["code"]) == (400, "invalid_request")


def test_a_body_larger_than_any_route_takes_is_a_413_before_it_is_sent(stack: LocalStack) -> None:
    # Only the head is sent: the answer cannot have waited for the body.
    status, _, body = exchange(stack, post_head(str(MAX_REQUEST_BYTES + 1)))
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    status, _, body = exchange(stack, post_head(str(10**30)))
    assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_a_client_still_sending_a_refused_body_reads_the_413_not_a_reset(stack: LocalStack) -> None:
    with connect(stack) as s:
        s.sendall(post_head(str(MAX_REQUEST_BYTES + 1)) + b"x" * (1 << 20))
        status, _, body = parse(read_all(s))
    assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_a_chunked_body_is_refused_clearly(stack: LocalStack) -> None:
    data = (
        f"POST {RANK_METRICS} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
    ).encode()
    status, headers, body = exchange(stack, data)
    assert (status, body["error"]["code"]) == (411, "length_required")
    assert "Content-Length" in body["error"]["message"] and headers["connection"] == "close"


def test_header_floods_are_431_in_the_contract_shape(stack: LocalStack) -> None:
    many = "".join(f"X-{i}: y\r\n" for i in range(200))
    status, _, body = exchange(stack, f"GET /v1/x HTTP/1.1\r\n{many}\r\n".encode())
    assert (status, body["error"]["code"]) == (431, "headers_too_large")
    long_line = b"X: " + b"y" * (MAX_HEAD_BYTES + 1)
    status, _, body = exchange(stack, b"GET /v1/x HTTP/1.1\r\n" + long_line + b"\r\n\r\n")
    assert (status, body["error"]["code"]) == (431, "headers_too_large")
    # Many headers each under the line limit, together far over the head's.
    lines = b"".join(b"X-%d: %s\r\n" % (i, b"y" * 60000) for i in range(3))
    status, _, body = exchange(stack, b"GET /v1/x HTTP/1.1\r\n" + lines + b"\r\n")
    assert (status, body["error"]["code"]) == (431, "headers_too_large")
    status, _, body = exchange(stack, b"GET /" + b"y" * (MAX_HEAD_BYTES + 1) + b" HTTP/1.1\r\n\r\n")
    assert (status, body["error"]["code"]) == (414, "uri_too_long")
    status, _, body = exchange(stack, b"GARBAGE\r\n\r\n")
    assert (status, body["error"]["code"]) == (400, "invalid_request")


def test_a_stalled_body_is_answered_408_within_the_bound(stack: LocalStack) -> None:
    with connect(stack, timeout=REQUEST_S + SLACK_S) as s:
        started = time.monotonic()
        s.sendall(post_head("100") + b'{"st')
        status, headers, body = parse(read_all(s))
        waited = time.monotonic() - started
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert headers["connection"] == "close"
    assert REQUEST_S - 0.1 <= waited <= REQUEST_S + SLACK_S


def test_a_dripping_head_cannot_hold_a_thread_past_the_bound(stack: LocalStack) -> None:
    """Slowloris: one byte of headers every 0.2 s, each read well inside a per-read timeout; the request's
    deadline still ends it."""
    with connect(stack) as s:
        s.sendall(b"GET /v1/x HTTP/1.1\r\n")
        started = time.monotonic()
        answer = b""
        while time.monotonic() - started < REQUEST_S + SLACK_S:
            if select.select([s], [], [], 0.2)[0]:
                answer = read_all(s)
                break
            s.sendall(b"X")
        waited = time.monotonic() - started
    assert answer, "the server still waits for the dripping request"
    status, _, body = parse(answer)
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert waited <= REQUEST_S + SLACK_S


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(stack: LocalStack) -> None:
    with connect(stack, timeout=IDLE_S + SLACK_S) as s:
        started = time.monotonic()
        assert s.recv(1) == b""  # closed without an answer: there was no request
        assert IDLE_S - 0.1 <= time.monotonic() - started <= IDLE_S + SLACK_S


def test_the_stack_still_serves_after_the_hostile_requests(stack: LocalStack) -> None:
    body = json.dumps({"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}}).encode()
    head = (
        f"POST {RANK_METRICS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {stack.token}\r\n"
        f"Idempotency-Key: after\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, _, answer = exchange(stack, head + body)
    assert (status, answer["status"]) == (201, "stored")


def test_thousands_of_concurrent_connections_are_held_without_a_reset(stack: LocalStack) -> None:
    """``CONNECTIONS`` connections opened as fast as connect returns (in a thread, bounded), all held
    open at once, then each asks for a path with no route (answered by the front, no worker) and must
    get its 404."""
    requested, cap = listen_backlog()
    assert requested == LISTEN_BACKLOG
    sockets: list[socket.socket] = []
    failures: list[OSError] = []

    def open_all() -> None:
        for _ in range(CONNECTIONS):
            try:
                sockets.append(connect(stack, timeout=30))
            except OSError as exc:
                failures.append(exc)

    opener = threading.Thread(target=open_all, daemon=True)
    started = time.monotonic()
    opener.start()
    opener.join(timeout=120)
    opened_s = time.monotonic() - started
    try:
        assert not opener.is_alive(), f"{len(sockets)} of {CONNECTIONS} connected in 120 s"
        request = b"GET /held HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        for s in sockets:
            s.sendall(request)
        held = 0
        for s in sockets:
            try:
                if s.recv(64).startswith(b"HTTP/1.1 404"):
                    held += 1
            except OSError as exc:
                failures.append(exc)
    finally:
        for s in sockets:
            s.close()
    print(
        f"{held} of {CONNECTIONS} concurrent connections held (opened in {opened_s:.2f} s; listen backlog "
        f"{requested}, net.core.somaxconn {cap})"
    )
    assert (held, failures[:3]) == (CONNECTIONS, [])
