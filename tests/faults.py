"""A batch-route server for fault tests, stdlib only (the client tests run with nothing else installed).

``FaultServer()`` stores events itself, exactly once per ``event_id`` as the contract's batch routes do
(an event whose metrics hold the key ``reject-me`` is rejected per event): rank events in ``events``,
``run.log`` scalars in ``scalars``, and run updates (``PATCH`` of the run) in ``updates`` (one whose
body or config holds the key ``reject-me`` gets a 400); ``calls`` lists every request's method and path
in arrival order. ``FaultServer(target=URL)`` forwards every request to a real API (the local stack)
instead. Either way the test can make it answer
errors for a while, go down and come back on the same port, or hold a request until released.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def free_port() -> int:
    """A port nothing listens on now, for a server a test starts on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api(stack: Any, path: str, body: Any = None) -> Any:
    """GET (or, with ``body``, POST as JSON) ``path`` of a stack with its token; the decoded answer."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {stack.token}", "Content-Type": "application/json"}
    request = urllib.request.Request(stack.url + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def call(stack: Any, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """Any request to a stack (its own token unless ``token``): the status and the decoded answer,
    errors included."""
    import urllib.error

    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token or stack.token}", "Content-Type": "application/json"}
    request = urllib.request.Request(stack.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def wait_for(condition: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def update_kind(body: dict[str, Any]) -> str:
    """A run update in a word: ``finished``, a process record's state (``started``, ``beat``, ``ended
    exception``), else its fields (``hosts``, ``config``)."""
    process = body.get("process")
    if process:
        return " ".join(str(part) for part in (process["state"], process.get("how")) if part)
    if body.get("status"):
        return str(body["status"])
    return " ".join(sorted(set(body) - {"time"}))


def update_kinds(server: FaultServer) -> list[str]:
    return [update_kind(body) for _, _, body in server.updates]


def calls_named(server: FaultServer) -> list[tuple[str, str]]:
    """``server.calls`` with each run update named by its kind (``("PATCH", "started")``) rather than by
    its path (every run update has the run's); for servers that stored every PATCH they were sent."""
    kinds = iter(update_kinds(server))
    return [(method, next(kinds) if method == "PATCH" else path) for method, path in server.calls]


class FaultServer:
    def __init__(self, target: str | None = None) -> None:
        self.target = target
        self.lock = threading.Lock()
        self.events: dict[str, dict[str, Any]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        #: Run updates as (path, Idempotency-Key, body), in arrival order.
        self.updates: list[tuple[str, str, dict[str, Any]]] = []
        self.calls: list[tuple[str, str]] = []
        self.requests = 0
        self.statuses: list[int] = []
        self.auth: set[str] = set()
        #: Events the real API behind a forwarding server answered "stored" for, summed over all batches.
        self.stored_upstream = 0
        self._failures: list[tuple[int, str | None]] = []
        #: Hold the next request (True), or the next of one method ("POST": the next batch), until
        #: ``release``.
        self.hold_next: bool | str = False
        #: A test's own rule, asked first for each request (method, path, body): None to serve it as
        #: usual, else (status, Retry-After or None) to answer, or status 0 to never answer (held until
        #: ``release``).
        self.rule: Callable[[str, str, bytes], tuple[int, str | None] | None] | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                status, headers, body = outer._handle(
                    self.command, self.path, dict(self.headers.items()), raw
                )
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PATCH = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self._handler = Handler
        self.server = self._serve(0)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, port: int) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    # --- faults ---------------------------------------------------------------------------------

    def fail(self, times: int, status: int, retry_after: str | None = "0") -> None:
        with self.lock:
            self._failures += [(status, retry_after)] * times

    def down(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def up(self) -> None:
        self.server = self._serve(self.port)

    def close(self) -> None:
        self.release.set()
        self.down()

    # --- serving --------------------------------------------------------------------------------

    def _handle(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        with self.lock:
            self.requests += 1
            self.calls.append((method, path))
            failure = self._failures.pop(0) if self._failures else None
            hold = self.hold_next is True or self.hold_next == method
            if hold:
                self.hold_next = False
        if failure is None and self.rule is not None:
            failure = self.rule(method, path, raw)
            if failure is not None and failure[0] == 0:
                self.held.set()
                self.release.wait(120)
                return 503, {}, b""
        self.auth.add(headers.get("Authorization", ""))
        if hold:
            self.held.set()
            self.release.wait(120)
        if failure:
            status, retry_after = failure
            self.statuses.append(status)
            body = json.dumps({"error": {"code": "unavailable", "message": "injected failure"}}).encode()
            extra = {"Retry-After": retry_after} if retry_after is not None else {}
            return status, {"content-type": "application/json", **extra}, body
        if self.target:
            status, out_headers, body = self._forward(method, path, headers, raw)
            if status == 200 and method == "POST":
                with self.lock:
                    self.stored_upstream += int(json.loads(body).get("stored", 0))
        elif method == "PATCH":
            status, out_headers, body = self._update(path, headers, raw)
        else:
            status, out_headers, body = self._store(path, raw)
        self.statuses.append(status)
        return status, out_headers, body

    def _forward(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        forwarded = ("authorization", "content-type", "idempotency-key")
        keep = {k: v for k, v in headers.items() if k.lower() in forwarded}
        request = urllib.request.Request(
            f"{self.target}{path}", data=raw or None, headers=keep, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, {"content-type": "application/json"}, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, {"content-type": "application/json"}, exc.read()

    def _update(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, dict[str, str], bytes]:
        body = json.loads(raw)
        if "reject-me" in body or "reject-me" in (body.get("config") or {}):
            error = {"code": "invalid_request", "message": "reject-me: not welcome"}
            return 400, {"content-type": "application/json"}, json.dumps({"error": error}).encode()
        key = next((v for k, v in headers.items() if k.lower() == "idempotency-key"), "")
        with self.lock:
            self.updates.append((path, key, body))
        record = {"run_id": path.rsplit("/", 1)[-1], "status": body.get("status", "live")}
        return 200, {"content-type": "application/json"}, json.dumps(record).encode()

    def _store(self, path: str, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        events = json.loads(raw)["events"]
        store = self.scalars if path.endswith("/scalars/batch") else self.events
        results = []
        with self.lock:
            for event in events:
                eid = event["event_id"]
                if "reject-me" in event["metrics"]:
                    error = {"code": "invalid_request", "message": "metrics: reject-me is not welcome"}
                    results.append({"event_id": eid, "status": "rejected", "error": error})
                elif eid in store:
                    results.append({"event_id": eid, "status": "duplicate"})
                else:
                    store[eid] = event
                    results.append({"event_id": eid, "status": "stored"})
        counts = {s: sum(r["status"] == s for r in results) for s in ("stored", "duplicate", "rejected")}
        return 200, {"content-type": "application/json"}, json.dumps({"results": results, **counts}).encode()


class Receiver:
    """A webhook receiver on 127.0.0.1: keeps every JSON body it is sent; answers ``fail`` requests
    with a 500 first; ``down()`` stops listening, ``up()`` listens again on the same port."""

    def __init__(self, fail: int = 0) -> None:
        self.port = free_port()
        self.fail = fail
        self.posts: list[dict[str, Any]] = []
        self.arrived: list[float] = []  # time.time() of each post kept
        self.attempts = 0
        self.ids: list[str] = []
        self._server: ThreadingHTTPServer | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def up(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.attempts += 1
                if receiver.fail > 0:
                    receiver.fail -= 1
                    self.send_response(500)
                else:
                    receiver.posts.append(body)
                    receiver.arrived.append(time.time())
                    receiver.ids.append(self.headers["X-InstantML-Delivery"])
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def opened(self, run_id: str) -> list[dict[str, Any]]:
        return [p for p in self.posts if p["run_id"] == run_id and p["state"] == "opened"]
