"""Sending events through the batch routes and run updates through the run route, shared by the
in-process and the spool uploaders.

One rule set for both: every event travels with its ``event_id``, so a retry after a lost response
stores nothing twice. Network errors, 429 and 5xx are transient (retried with exponential backoff and
jitter, honouring ``Retry-After``); a whole-request 4xx is not.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

MAX_BACKOFF_S = 10.0
#: Statuses that say "the request was fine, the server is not": retry later.
TRANSIENT_STATUSES = frozenset({408, 425, 429})
#: Whole-request refusals that no retry fixes and that are about the setup, not the events.
SETUP_STATUSES = frozenset({401, 403, 404})
#: The token is refused: nothing sent with it can get through. (A run update's 404 or 405 is not one of
#: these: an older server without the route must not hold up the events behind it.)
AUTH_STATUSES = frozenset({401, 403})


class Transient(Exception):
    """Network error, 429 or 5xx: send the same batch again later."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Refused(Exception):
    """The server refused the whole request with a 4xx: ``status`` and the server's ``error`` object."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {error.get('message', error.get('code', 'refused'))}")
        self.status = status
        self.error = error

    @property
    def about_setup(self) -> bool:
        """Bad token, wrong project or URL: nothing is wrong with the events themselves."""
        return self.status in SETUP_STATUSES


@dataclass
class BatchResult:
    stored: int = 0
    duplicate: int = 0
    #: The results of rejected events, each with the server's ``error`` object.
    rejected: list[dict[str, Any]] = field(default_factory=list)


def backoff(failures: int, retry_after: float | None, cap: float = MAX_BACKOFF_S) -> float:
    """Seconds to wait before attempt ``failures + 1``: the server's ``Retry-After`` when it gave one,
    else exponential (0.5 s, 1 s, 2 s, ... up to ``cap``), with +/-20 % jitter so uploaders spread out."""
    base = retry_after if retry_after is not None else min(cap, 0.25 * 2 ** min(failures, 10))
    return base * random.uniform(0.8, 1.2)


def post_batch(url: str, api_key: str, body: bytes, timeout: float = 60.0) -> BatchResult:
    """POST one ``{"events": [...]}`` body to a batch route URL.

    Raises :class:`Transient` or :class:`Refused`; returns the per-event outcome otherwise.
    """
    result = _send("POST", url, api_key, body, {}, timeout)
    if not isinstance(result, dict) or not isinstance(result.get("results"), list):
        raise Transient(f"unexpected answer from the batch route: {str(result)[:200]}")
    out = BatchResult(stored=int(result.get("stored", 0)), duplicate=int(result.get("duplicate", 0)))
    out.rejected = [r for r in result["results"] if isinstance(r, dict) and r.get("status") == "rejected"]
    return out


def patch_run(
    url: str, api_key: str, update: dict[str, Any], event_id: str, timeout: float = 60.0
) -> dict[str, Any]:
    """PATCH one run update (``{"config": ...}`` / ``{"status": "finished"}``) to the run's URL, with
    ``event_id`` as its ``Idempotency-Key``. Same rules as :func:`post_batch`: raises
    :class:`Transient` or :class:`Refused`; returns the run record the server answers with.

    The body is compact JSON, as the config limit is measured (``run.check_config``): with the default
    separators a config just under the limit would be a body the server refuses."""
    body = json.dumps(update, allow_nan=False, separators=(",", ":")).encode()
    result = _send("PATCH", url, api_key, body, {"Idempotency-Key": event_id}, timeout)
    if not isinstance(result, dict):
        raise Transient(f"unexpected answer from the run route: {str(result)[:200]}")
    return result


def _send(
    method: str, url: str, api_key: str, body: bytes | None, extra: dict[str, str], timeout: float
) -> Any:
    """One JSON request; the decoded answer of a 2xx, else :class:`Transient` or :class:`Refused`."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json", **extra}
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        error = _error_object(exc)
        if exc.code in TRANSIENT_STATUSES or exc.code >= 500:
            raise Transient(f"HTTP {exc.code}: {error.get('message', '')}", _retry_after(exc)) from None
        raise Refused(exc.code, error) from None
    except urllib.error.URLError as exc:  # refused, unknown host, ...: say what, not "<urlopen error ...>"
        reason = exc.reason
        raise Transient(
            f"{type(reason).__name__}: {reason}" if isinstance(reason, Exception) else str(reason)
        ) from None
    except (OSError, ValueError) as exc:  # reset, timeout, a torn or non-JSON answer
        raise Transient(f"{type(exc).__name__}: {exc}") from None


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    try:
        return max(0.0, float(exc.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _error_object(exc: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        error = json.load(exc)["error"]
    except Exception:  # noqa: BLE001 - any unreadable body: fall back to the status text
        error = None
    if isinstance(error, dict):
        return error
    return {"code": f"http_{exc.code}", "message": str(exc.reason)}


def request(method: str, url: str, api_key: str, document: Any = None, timeout: float = 30.0) -> Any:
    """One JSON request of the API's (``document`` as its body, or none); the decoded answer of a 2xx.
    Raises :class:`Transient` (network, 429, 5xx) or :class:`Refused` (4xx), as the uploads do."""
    body = None if document is None else json.dumps(document, separators=(",", ":")).encode()
    return _send(method, url, api_key, body, {}, timeout)
