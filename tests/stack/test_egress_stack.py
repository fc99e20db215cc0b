"""The outgoing-request policy on the real local stack (shared/watch/egress.py): ``PUT .../alerts``
refuses every metadata and link-local spelling with a 400 naming the field, allows the developer's own
loopback and private targets; a stack set to the deployed default (``WEBHOOK_ALLOWED_NETWORKS=""``)
refuses them too, and a name that only a lookup shows to be loopback is refused when the alert is sent:
nothing reaches the receiver, and ``GET .../alerts`` says why."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from instantml import routes
from tests.faults import Receiver, call, wait_for
from tests.unit.test_egress import INWARD, NEVER

PROJECT = "egress-stack"
ALERTS = routes.ALERTS.format(project=PROJECT)


@pytest.fixture(scope="module")
def stack(local_stack: Any) -> Any:
    return local_stack


def put(stack: Any, url: str) -> tuple[int, Any]:
    return call(stack, "PUT", ALERTS, {"webhooks": [{"url": url}]})


def test_metadata_spellings_are_refused_at_put_and_a_developers_own_targets_allowed(stack: Any) -> None:
    for url in NEVER:
        status, answer = put(stack, url)
        assert status == 400, (url, answer)
        assert [d["field"] for d in answer["error"]["details"]] == ["webhooks[0].url"], url
        assert "refused as a webhook target" in answer["error"]["details"][0]["message"]
    for url in INWARD:
        status, answer = put(stack, url)
        assert status == 200, (url, answer)
        assert answer["webhooks"] == [{"url": url, "min_severity": "warning", "last_delivery": None}]
    call(stack, "DELETE", ALERTS)


def own_name() -> str:
    """This machine's name, which the resolver (/etc/hosts) maps to one of its own addresses."""
    name = socket.gethostname()
    addresses = {info[4][0] for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    assert addresses and not any(ipaddress.ip_address(a).is_global for a in addresses), addresses
    return name


@pytest.fixture(scope="module")
def strict_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from infra.local import LocalStack

    saved = dict(os.environ)
    os.environ["WEBHOOK_ALLOWED_NETWORKS"] = ""  # the template's default: public targets only
    running = LocalStack(port=0, data_dir=tmp_path_factory.mktemp("strict"), watch_interval=0.5).start()
    try:
        yield running
    finally:
        running.stop()
        os.environ.clear()
        os.environ.update(saved)


def test_a_strict_stack_refuses_inward_targets_at_put_and_what_a_lookup_shows_at_send(
    strict_stack: Any,
) -> None:
    receiver = Receiver()
    try:
        status, answer = put(strict_stack, receiver.url)  # 127.0.0.1: told from the URL
        assert status == 400 and "127.0.0.1 is loopback" in answer["error"]["details"][0]["message"]
        hidden = f"http://{own_name()}:{receiver.port}/hook"  # loopback, but only a lookup says so
        status, answer = put(strict_stack, hidden)
        assert status == 200, answer

        # A run whose rank 1 stops while the others go on: the watch opens an alert for it.
        now = time.time()
        events = [
            {
                "event_id": f"e-{step}-{rank}",
                "step": step,
                "rank": rank,
                "world_size": 4,
                "metrics": {"train/loss": 1.0 + rank / 100},
                "time": now - 40 + step,
            }
            for step in range(40)
            for rank in range(4)
            if not (rank == 1 and step > 10)
        ]
        path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id="r1")
        assert call(strict_stack, "POST", path, {"events": events})[0] == 200

        def last_delivery() -> Any:
            hooks = call(strict_stack, "GET", ALERTS)[1]["webhooks"]
            return hooks[0]["last_delivery"]

        last = wait_for(last_delivery, timeout=120, what="the alert's delivery to be tried")
        assert last["state"] == "refused", last
        assert "resolves to 127." in last["reason"] and "loopback" in last["reason"], last
        assert receiver.attempts == 0  # nothing was sent
    finally:
        receiver.down()
