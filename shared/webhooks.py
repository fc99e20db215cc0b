"""Sending an alert: one POST of JSON to a webhook (the outgoing edge, as the store adapters are the
storage edge). Standard library only; the URL is a secret and never appears in what is returned."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from shared.store.port import Delivery

SEND_TIMEOUT_S = 10.0


def send(delivery: Delivery, timeout: float = SEND_TIMEOUT_S) -> str | None:
    """POST the alert once; None when the webhook answered 2xx, else what went wrong (without the URL:
    it is a secret)."""
    body = json.dumps(delivery.payload, separators=(",", ":"), ensure_ascii=True).encode()
    request = urllib.request.Request(
        delivery.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "instantml-alerts/1",
            "X-InstantML-Delivery": delivery.delivery_id,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read(65536)
            return None
    except urllib.error.HTTPError as exc:
        return f"the webhook answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"the webhook could not be reached ({type(reason).__name__})"
