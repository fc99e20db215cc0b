"""Sending an alert: one POST of JSON to a webhook (the outgoing edge, as the store adapters are the
storage edge), through the outgoing-request policy (``shared.watch.egress``): the address checked,
connected to as checked, no redirect followed, no proxy, the whole exchange bounded in time and in what
is read. Standard library only; the URL is a secret and never appears in what is returned."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from typing import Literal, NamedTuple

from shared.store.port import Delivery
from shared.watch.egress import Policy, Refused, Resolver, Unresolved, open_pinned

#: The whole exchange (connect, send, the answer's head and what is read of its body).
SEND_TIMEOUT_S = 10.0
#: What is read of a webhook's answer at most (then the connection is closed).
MAX_ANSWER_BYTES = 65536


class Outcome(NamedTuple):
    """How one POST went: ``delivered`` (2xx), ``failing`` (worth another attempt: an error answer, a
    redirect, a timeout, nothing listening) or ``refused`` (the policy forbids the target: never
    retried), with the reason (None when delivered)."""

    state: Literal["delivered", "failing", "refused"]
    reason: str | None = None


DELIVERED = Outcome("delivered")


def send(
    delivery: Delivery,
    policy: Policy | None = None,
    timeout: float = SEND_TIMEOUT_S,
    resolve: Resolver | None = None,
) -> Outcome:
    """POST the alert once, within ``timeout`` in all."""
    body = json.dumps(delivery.payload, separators=(",", ":"), ensure_ascii=True).encode()
    deadline = time.monotonic() + timeout
    try:
        connection, target = open_pinned(delivery.url, timeout, policy or Policy.from_environment(), resolve)
    except Refused as exc:
        return Outcome("refused", str(exc))
    except Unresolved as exc:
        return Outcome("failing", str(exc))
    except ValueError:
        return Outcome("refused", "the webhook's URL is not an http(s) URL")
    watchdog: threading.Timer | None = None
    late = threading.Event()
    try:
        connection.connect()
        # A socket timeout bounds each read, not their sum: at the deadline the socket is shut, however
        # slowly the answer trickles in, and what was read by then does not count.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (connection.sock, late))
        watchdog.start()
        connection.request(
            "POST",
            target,
            body=body,
            headers={
                "Content-Type": "application/json",
                "User-Agent": "instantml-alerts/1",
                "X-InstantML-Delivery": delivery.delivery_id,
            },
        )
        answer = connection.getresponse()
        answer.read(MAX_ANSWER_BYTES)  # what is left unread is dropped with the connection
    except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
        if late.is_set() or isinstance(exc, TimeoutError):
            return Outcome("failing", f"the webhook did not answer within {timeout:g} s")
        return Outcome("failing", f"the webhook could not be reached ({type(exc).__name__})")
    finally:
        if watchdog is not None:
            watchdog.cancel()
        connection.close()
    if late.is_set():
        return Outcome("failing", f"the webhook did not answer within {timeout:g} s")
    if 300 <= answer.status < 400:
        return Outcome("failing", f"the webhook answered HTTP {answer.status}: a redirect, not followed")
    if not 200 <= answer.status < 300:
        return Outcome("failing", f"the webhook answered HTTP {answer.status}")
    return DELIVERED


def _shut(sock: socket.socket | None, late: threading.Event) -> None:
    late.set()
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
