"""What several benchmarks drive their load and serve their stubs with, written once.

:func:`in_threads` hands items to a few keep-alive client threads (a request is taken by the first free
one); :func:`serve` starts a stub HTTP server on 127.0.0.1 in a thread, for handlers built on
:class:`QuietHandler`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TypeVar


class Closeable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closeable)
T = TypeVar("T")


def in_threads(
    connect: Callable[[], C],
    items: Iterable[T],
    work: Callable[[C, T], None],
    threads: int,
    closing: Callable[[C], None] | None = None,
) -> float:
    """``work(client, item)`` for every item, from ``threads`` threads with a client each (``connect()``,
    closed at the end after ``closing(client)``); the seconds it took. The first error stops every thread
    and is raised."""
    iterator, lock, errors = iter(items), threading.Lock(), list[BaseException]()

    def worker() -> None:
        client = connect()
        try:
            while not errors:
                with lock:
                    item = next(iterator, None)
                if item is None:
                    return
                work(client, item)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller
            errors.append(exc)
        finally:
            if closing is not None:
                closing(client)
            client.close()

    running = [threading.Thread(target=worker) for _ in range(threads)]
    started = time.perf_counter()
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


class QuietHandler(BaseHTTPRequestHandler):
    """A stub's request handler: no log line per request, and one way to answer."""

    def send(self, status: int, payload: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A server of ``handler`` on a free port of 127.0.0.1, serving from a daemon thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
