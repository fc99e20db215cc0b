"""A project's alert destinations and the sending of alerts (contract 7).

``PUT .../alerts`` takes ``{"webhooks": [{"url": ..., "min_severity": ...}]}``: at most
``MAX_WEBHOOKS`` http(s) URLs, each with a severity (default ``warning``). A webhook URL is the
project's secret (a Slack incoming webhook's URL is its credential): it is never logged, and shown
only to the project's own tokens.

An alert is one POST of JSON per webhook (``shared.watch.rounds`` decides what and when;
``shared.watch.webhooks`` sends it). ``retry_at`` says when to try again: exponential backoff with jitter from
``FIRST_RETRY_S`` to ``MAX_RETRY_S``, for ``GIVE_UP_AFTER_S`` (contract 7: at least 10 minutes) before it is
given up and kept, marked dead, for a person to see.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.errors import FieldError, InvalidInput
from shared.ingest.bodies import validate
from shared.severity import Severity
from shared.store.port import Delivery, LastDelivery, PendingDelivery, Webhook
from shared.watch.egress import Policy
from shared.watch.webhooks import Outcome

#: Contract 7.
MAX_WEBHOOKS = 8
MAX_URL_LENGTH = 2048
SEND_TIMEOUT_S = 10.0
FIRST_RETRY_S = 5.0
MAX_RETRY_S = 120.0
GIVE_UP_AFTER_S = 30 * 60.0


class WebhookBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_LENGTH)]
    min_severity: Severity = "warning"

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.isascii() or any(ord(c) < 33 or ord(c) == 127 for c in value):
            raise ValueError("must be an http:// or https:// URL of printable ASCII, with no spaces")
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises on a port out of range
        except ValueError:
            raise ValueError("must be an http:// or https:// URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value


class AlertsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    webhooks: list[WebhookBody] = Field(max_length=MAX_WEBHOOKS)


class LastDeliveryBody(BaseModel):
    """How the last POST to a webhook went (``GET .../alerts``; ``shared.store.port.LastDelivery``)."""

    state: Literal["delivered", "failing", "refused"]
    reason: str | None
    at: float


class WebhookAnswer(BaseModel):
    url: str
    min_severity: Severity
    last_delivery: LastDeliveryBody | None


class AlertsAnswer(BaseModel):
    """What the alerts routes answer: the webhooks, each with its last delivery (null before one)."""

    webhooks: list[WebhookAnswer]


def parse_webhooks(document: Any, policy: Policy) -> list[Webhook]:
    """The body of ``PUT .../alerts``; ``InvalidInput`` names the field at fault, a URL whose target
    ``policy`` refuses from its spelling alone included (what only a lookup can tell is refused when
    the alert is sent, and said in ``GET .../alerts``)."""
    body = validate(AlertsBody, document, "alerts body")
    refused = [
        FieldError(f"webhooks[{n}].url", f"is refused as a webhook target: {why}")
        for n, hook in enumerate(body.webhooks)
        if (why := policy.url_refusal(hook.url)) is not None
    ]
    if refused:
        raise InvalidInput("a webhook's URL points where alerts may not be sent", refused)
    return [Webhook(hook.url, hook.min_severity) for hook in body.webhooks]


def retry_at(attempts: int, created: float, now: float) -> float | None:
    """When to try a delivery again after ``attempts`` failures; None once it is time to give up."""
    if now - created >= GIVE_UP_AFTER_S:
        return None
    wait = min(MAX_RETRY_S, FIRST_RETRY_S * 2.0 ** max(0, attempts - 1))
    jitter: float = random.uniform(0.5, 1.0)
    return now + wait * jitter


class Outbox(Protocol):
    """Alerts waiting to be sent (the local stack's database; on AWS the queue holds them)."""

    def due_deliveries(self, now: float, limit: int) -> list[PendingDelivery]: ...

    def delivery_done(self, delivery_id: str) -> None: ...

    def delivery_failed(self, delivery_id: str, error: str, next_at: float | None) -> None: ...

    def note_delivery(self, project: str, url: str, last: LastDelivery) -> None: ...


def deliver_due(
    outbox: Outbox, now: float, send: Callable[[Delivery], Outcome], threads: int = 4, limit: int = 64
) -> int:
    """Send the alerts due at ``now`` (a few at once: one slow webhook does not hold up the others);
    each sent one leaves the outbox, each failed one waits for its next attempt or is given up, each
    refused one (the outgoing-request policy) is given up at once. How each went is noted for
    ``GET .../alerts``. Returns how many were attempted."""
    due = outbox.due_deliveries(now, limit)
    if not due:
        return 0
    with ThreadPoolExecutor(min(threads, len(due))) as pool:
        outcomes = list(pool.map(lambda pending: send(pending.delivery), due))
    for pending, outcome in zip(due, outcomes, strict=True):
        delivery = pending.delivery
        outbox.note_delivery(delivery.project, delivery.url, LastDelivery(outcome.state, outcome.reason, now))
        if outcome.state == "delivered":
            outbox.delivery_done(delivery.delivery_id)
            continue
        refused = outcome.state == "refused"
        next_at = None if refused else retry_at(pending.attempts + 1, pending.created, now)
        outbox.delivery_failed(delivery.delivery_id, outcome.reason or outcome.state, next_at)
        log_undelivered(delivery, outcome, now, next_at)
    return len(due)


def log_undelivered(delivery: Delivery, outcome: Outcome, now: float, next_at: float | None) -> None:
    """One line on stderr for an alert that did not go (never its URL: a secret)."""
    state = delivery.payload.get("state")
    what = f"an alert for project {delivery.project} ({state}, delivery {delivery.delivery_id})"
    if outcome.state == "refused":
        print(
            f"instantml alerts: {what} was refused: {outcome.reason}; not retried",
            file=sys.stderr,
            flush=True,
        )
        return
    when = (
        f"given up after {GIVE_UP_AFTER_S / 60:.0f} minutes"
        if next_at is None
        else f"next attempt in {next_at - now:.0f} s"
    )
    print(
        f"instantml alerts: {what} was not delivered: {outcome.reason}; {when}", file=sys.stderr, flush=True
    )
