"""Issue 28's headline cases over HTTP, against the real local stack (SQLite): raw bytes on the wire,
then a run whose config holds a path decoded with ``surrogateescape``, logged through the client."""

from __future__ import annotations

import json
import socket
import urllib.request
import uuid
from typing import Any
from urllib.parse import urlsplit

import instantml as im
from instantml import routes

PROJECT = "hostile-http"


def raw_request(
    stack: Any, method: bytes, path: bytes, body: bytes = b"", auth: bytes | None = None
) -> tuple[int, Any]:
    """One request as bytes (a path or header that ``http.client`` would refuse to send), its answer."""
    url = urlsplit(stack.url)
    token = stack.token.encode() if auth is None else auth
    head = (
        method + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer " + token + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection((url.hostname or "", url.port or 80), timeout=60) as connection:
        connection.sendall(head + body)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    status_line, _, rest = response.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload)


def fields(answer: Any) -> list[str]:
    return [d["field"] for d in answer["error"].get("details", [])]


def test_poison_requests_over_http_are_refused_in_the_contract_shape(local_stack: Any) -> None:
    run = f"/v1/projects/{PROJECT}/runs/{uuid.uuid4().hex}".encode()
    event = b'"step":1,"rank":0,"world_size":1'
    cases = [
        # (method, path, body, auth, status, a field the error names)
        (b"PATCH", run, b'{"config":{"p":"\\udcff"}}', None, 400, "config.p"),
        (b"PATCH", run, '{"config":{"p":"\udcff"}}'.encode("utf-8", "surrogatepass"), None, 400, "config.p"),
        (b"POST", run + b"/rank-metrics", b"{" + event + b',"metrics":{"loss\\n":1}}', None, 400, "metrics"),
        (
            b"POST",
            run + b"/rank-metrics",
            b"{" + event + b',"metrics":{"a":1},"event_id":"abc\\n"}',
            None,
            400,
            "event_id",
        ),
        (
            b"POST",
            run + b"/rank-metrics",
            b"{" + event + b',"metrics":{"a":1},"time":1e300}',
            None,
            400,
            "time",
        ),
        (b"POST", run + b"/rank-metrics/batch", b'{"events":[],"junk":1}', None, 400, "junk"),
        (b"GET", "/v1/projects/prоjB/runs".encode(), b"", None, 400, "project"),  # Cyrillic о, raw UTF-8
        (b"GET", b"/v1/projects/pr%D0%BEjB/runs", b"", None, 400, "project"),
        # the server reads the request line as latin-1: "Ã©", and "©" is in no route's segment (404)
        (b"GET", run.replace(PROJECT.encode(), "projé".encode()), b"", None, 404, None),
        (b"GET", f"/v1/projects/{PROJECT}/runs".encode(), b"", "токен".encode(), 401, None),
        (b"GET", f"/v1/projects/{PROJECT}/runs".encode(), b"", b"t\xff\xfek", 401, None),
    ]
    for method, path, body, auth, status, field in cases:
        got, answer = raw_request(local_stack, method, path, body, auth)
        assert (got, set(answer)) == (status, {"error"}), (method, path, body, answer)
        assert field is None or any(f.startswith(field) for f in fields(answer)), (path, body, answer)


def test_a_config_holding_a_surrogateescape_path_does_not_hold_up_the_run(local_stack: Any) -> None:
    """A Trainer's output_dir decoded with surrogateescape: once the PATCH ahead of every event answered
    500 and the client retried it for ever (0 of 200 events stored). The client converts it now."""
    run_id = f"poison-{uuid.uuid4().hex[:8]}"
    run = im.init(
        PROJECT,
        run_id=run_id,
        upload_mode="thread",
        api_url=local_stack.url,
        api_key=local_stack.token,
        config={"output_dir": "/out/caf\udce9", "lr": 3e-4},
    )
    for step in range(200):
        run.log_rank_metrics({"train/loss": 1.0 / (step + 1)}, step=step, rank=0, world_size=1)
    run.finish(timeout=60)
    headers = {"Authorization": f"Bearer {local_stack.token}"}
    base = local_stack.url + routes.RUN.format(project=PROJECT, run_id=run_id)
    with urllib.request.urlopen(urllib.request.Request(base, headers=headers), timeout=60) as response:
        record = json.loads(response.read())
    assert record["config"] == {"output_dir": "/out/caf\\xe9", "lr": 3e-4}
    assert (record["status"], record["last_step"]) == ("finished", 199)
    summary = base + "/distributed?max_steps=200"
    with urllib.request.urlopen(urllib.request.Request(summary, headers=headers), timeout=60) as response:
        counts = json.loads(response.read())["reducers"]["train/loss"]["count"]
    assert sum(counts) == 200
