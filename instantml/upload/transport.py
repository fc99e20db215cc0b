"""Sending events through the batch routes and run updates through the run route, shared by the
in-process and the spool uploaders.

One rule set for both: every event travels with its ``event_id``, so a retry after a lost response
stores nothing twice. Network errors, 429 and 5xx are transient (retried with exponential backoff and
jitter, honouring ``Retry-After``); a whole-request 4xx is not.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from instantml import limits

MAX_BACKOFF_S = 10.0
#: Seconds the uploaders let events wait before they send them (``limits.UPLOAD_LINGER_S``).
LINGER_ENV = "INSTANTML_LINGER_S"
#: Environment variables (for tests and impatient users) that set the longest wait between attempts and
#: the poison rule below; their defaults are the constants here.
BACKOFF_MAX_ENV = "INSTANTML_BACKOFF_MAX_S"
POISON_ATTEMPTS_ENV = "INSTANTML_POISON_ATTEMPTS"
POISON_SECONDS_ENV = "INSTANTML_POISON_SECONDS"
POISON_SUCCESSES_ENV = "INSTANTML_POISON_SUCCESSES"
#: Statuses that say "the request was fine, the server is not": retry later.
TRANSIENT_STATUSES = frozenset({408, 425, 429})
#: Whole-request refusals that no retry fixes and that are about the setup, not the events.
SETUP_STATUSES = frozenset({401, 403, 404})
#: The token is refused: nothing sent with it can get through. (A run update's 404 or 405 is not one of
#: these: an older server without the route must not hold up the events behind it.)
AUTH_STATUSES = frozenset({401, 403})


class Transient(Exception):
    """Network error, 429 or 5xx: send the same batch again later."""

    def __init__(self, message: str, retry_after: float | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        #: The HTTP status (429, 5xx, ...), None for a network error or an unreadable answer.
        self.status = status

    @property
    def server_error(self) -> bool:
        """The server answered 5xx: it read the request and failed on it (not 429 "too many", not the
        network). Only these count towards setting a request aside (:class:`Attempts`)."""
        return self.status is not None and self.status >= 500


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


def _env_number(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


def linger_s(api_url: str) -> float:
    """How long an uploader lets events wait for more (``limits.UPLOAD_LINGER_S``): ``INSTANTML_LINGER_S``
    when set, else the local value for a server on this machine (a loopback host), else the deployed one."""
    configured = _env_number(LINGER_ENV, -1.0)
    if configured >= 0:
        return configured
    return limits.UPLOAD_LINGER_LOCAL_S if _loopback(api_url) else limits.UPLOAD_LINGER_S


def first_upload_spread_s(api_url: str, world_size: int | None) -> float:
    """The window in which an uploader of a ``world_size``-rank job sends its first request, at a
    random point (``limits.FIRST_UPLOADS_PER_S``): 0 for a single process, a job of unknown size, or a
    server on this machine."""
    if not world_size or _loopback(api_url):
        return 0.0
    return min(limits.FIRST_UPLOAD_SPREAD_MAX_S, world_size / limits.FIRST_UPLOADS_PER_S)


def _loopback(api_url: str) -> bool:
    host = (urllib.parse.urlsplit(api_url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def backoff(failures: int, retry_after: float | None, cap: float | None = None) -> float:
    """Seconds to wait before attempt ``failures + 1``: the server's ``Retry-After`` when it gave one,
    else exponential (0.5 s, 1 s, 2 s, ... up to ``cap``: ``INSTANTML_BACKOFF_MAX_S``, default 10 s),
    with +/-20 % jitter so uploaders spread out."""
    if cap is None:
        cap = _env_number(BACKOFF_MAX_ENV, MAX_BACKOFF_S)
    base = retry_after if retry_after is not None else min(cap, 0.25 * 2 ** min(failures, 10))
    return base * random.uniform(0.8, 1.2)


# --- telling a poison request from an outage ------------------------------------------------------
#
# A request the server refuses as bad input (a 4xx other than 401/403/408/429) is rejected at once.
# A request answered 5xx is retried, as the server may be down. But a request the server fails on
# for ever (a value it cannot store: the server's bug) must not hold up the run, so it is *set aside*
# (written to the spool's ``set-aside.jsonl`` with the reason; ``instantml sync --resend-set-aside``
# sends it again) when, and only when, all three hold:
#
# - it was answered 5xx at least ``attempts`` times (default 8),
# - over at least ``seconds`` (default 300 s) from its first 5xx,
# - and in that time at least ``successes`` (default 2) OTHER requests to the same server succeeded.
#
# During an outage nothing succeeds, so nothing is set aside: every request waits and is retried (the
# server's 429/503 ``Retry-After`` pauses every request to it). Network errors and 429 never count.
# While one request waits for its next attempt, the requests behind it go on (see ``MAX_HELD``), so
# the evidence of the third condition comes from the run's own traffic.

#: Requests one uploader keeps waiting for another attempt at once before it sends nothing new: during
#: an outage it sends at most this many requests per backoff period, not one per event.
MAX_HELD = 4


@dataclass
class PoisonRule:
    attempts: int = 8
    seconds: float = 300.0
    successes: int = 2

    @classmethod
    def from_env(cls) -> PoisonRule:
        """The rule with ``INSTANTML_POISON_ATTEMPTS`` / ``_SECONDS`` / ``_SUCCESSES`` where set."""
        default = cls()
        return cls(
            attempts=max(1, int(_env_number(POISON_ATTEMPTS_ENV, default.attempts))),
            seconds=_env_number(POISON_SECONDS_ENV, default.seconds),
            successes=max(1, int(_env_number(POISON_SUCCESSES_ENV, default.successes))),
        )


class Health:
    """What one server answered one uploader lately: requests it took, and when it asked to wait."""

    def __init__(self) -> None:
        self.successes = 0
        #: ``time.monotonic()`` before which nothing is sent (the server's ``Retry-After``).
        self.not_before = 0.0

    def succeeded(self) -> None:
        self.successes += 1

    def failed(self, exc: Transient) -> None:
        if exc.retry_after is not None:
            self.not_before = max(self.not_before, time.monotonic() + exc.retry_after)


@dataclass
class Attempts:
    """One request's failed attempts, and whether it is poison by :class:`PoisonRule`."""

    failures: int = 0
    server_errors: int = 0
    #: ``time.monotonic()`` of the first 5xx, and how many requests the server had taken by then.
    first_server_error: float | None = None
    successes_before: int = 0
    first_failure: float | None = None
    next_attempt: float = 0.0
    last_error: str = ""
    last_status: int | None = None
    #: It failed with a 5xx again after the server had taken other requests since its first one: the
    #: server is up and fails on this request (a run update of other fields may pass it).
    suspect: bool = False

    def failed(self, exc: Transient, health: Health) -> float:
        """Count a transient failure; returns the wait before the next attempt (also in
        ``next_attempt``)."""
        now = time.monotonic()
        health.failed(exc)
        self.failures += 1
        self.last_error = str(exc)
        if self.first_failure is None:
            self.first_failure = now
        if exc.server_error:
            self.server_errors += 1
            self.last_status = exc.status
            if self.first_server_error is None:
                self.first_server_error, self.successes_before = now, health.successes
            elif health.successes > self.successes_before:
                self.suspect = True
        delay = backoff(self.failures, exc.retry_after)
        self.next_attempt = now + delay
        return delay

    def others_succeeded(self, health: Health) -> int:
        return 0 if self.first_server_error is None else health.successes - self.successes_before

    def poison(self, rule: PoisonRule, health: Health) -> bool:
        return (
            self.first_server_error is not None
            and self.server_errors >= rule.attempts
            and time.monotonic() - self.first_server_error >= rule.seconds
            and self.others_succeeded(health) >= rule.successes
        )

    def describe(self, health: Health) -> str:
        """Why it waits or was set aside, in a sentence's words."""
        if not self.server_errors:
            return f"{self.failures} failed attempt(s), last: {self.last_error}"
        since = time.monotonic() - (self.first_server_error or time.monotonic())
        return (
            f"the server answered HTTP {self.last_status} to it {self.server_errors} time(s) over "
            f"{since:.0f} s while it took {self.others_succeeded(health)} other request(s)"
        )


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
            raise Transient(
                f"HTTP {exc.code}: {error.get('message', '')}", _retry_after(exc), exc.code
            ) from None
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
