"""The in-process upload mode: a background thread sends batches through the batch route.

The training thread only appends to a deque. The thread sends each event with its id inside the batch,
so a retry after a lost response stores nothing twice. Transient failures (network, 429, 5xx) are
retried with exponential backoff and jitter, honouring ``Retry-After``; per-event rejects are logged
with the server's reason.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any
from urllib.parse import quote

from instantml import limits, routes

log = logging.getLogger("instantml")

MAX_BACKOFF_S = 30.0


class UploadRejected(Exception):
    """The server refused a whole request (bad token, wrong project): retrying will not help."""


class ThreadUploader:
    def __init__(self, api_url: str, api_key: str, project: str, run_id: str, batch_size: int = 500) -> None:
        self._url = api_url + routes.RANK_METRICS_BATCH.format(
            project=quote(project, safe=""), run_id=quote(run_id, safe="")
        )
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self._batch_size = min(batch_size, limits.MAX_BATCH_EVENTS)
        self._pending: deque[dict[str, Any]] = deque()
        self._closing = threading.Event()
        self._wake = threading.Event()
        self.stored = 0
        self.duplicate = 0
        self.rejected: list[dict[str, Any]] = []
        self.fatal: str | None = None
        self._thread = threading.Thread(target=self._loop, name="instantml-uploader", daemon=True)
        self._thread.start()

    def write(self, event_id: str, body: dict[str, Any]) -> None:
        body["event_id"] = event_id
        self._pending.append(body)
        if len(self._pending) >= self._batch_size:
            self._wake.set()

    def close(self, timeout: float) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        left = len(self._pending)
        if self.fatal:
            log.error("instantml: %d event(s) were not uploaded: %s", left, self.fatal)
        elif left:
            log.warning(
                "instantml: %d event(s) still pending after %.0f s; the server may be down. "
                "Use upload_mode='spool' to keep events on disk across restarts.",
                left,
                timeout,
            )

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _loop(self) -> None:
        failures = 0
        while True:
            if not self._pending:
                if self._closing.is_set():
                    return
                self._wake.wait(0.25)
                self._wake.clear()
                continue
            batch = [self._pending[i] for i in range(min(self._batch_size, len(self._pending)))]
            try:
                self._send(batch)
            except UploadRejected as exc:
                self.fatal = str(exc)
                log.error("instantml: upload stopped: %s", exc)
                return
            except _Transient as exc:
                failures += 1
                delay = exc.retry_after or min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures, 6))
                delay *= random.uniform(0.8, 1.2)
                log.info("instantml: upload failed (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                continue
            failures = 0
            for _ in batch:
                self._pending.popleft()

    def _send(self, batch: list[dict[str, Any]]) -> None:
        data = json.dumps({"events": batch}, allow_nan=False).encode()
        request = urllib.request.Request(self._url, data=data, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                result = json.load(response)
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code == 429 or exc.code >= 500:
                raise _Transient(f"HTTP {exc.code}: {message}", _retry_after(exc)) from None
            raise UploadRejected(f"HTTP {exc.code}: {message}") from None
        except (OSError, ValueError) as exc:  # connection refused, reset, timeout, bad JSON
            raise _Transient(str(exc)) from None
        self.stored += result.get("stored", 0)
        self.duplicate += result.get("duplicate", 0)
        for item in result.get("results", []):
            if item.get("status") == "rejected":
                self.rejected.append(item)
                log.warning("instantml: event %s rejected: %s", item.get("event_id"), item.get("error"))


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    try:
        return max(0.0, float(exc.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(exc)["error"]["message"])
    except Exception:  # noqa: BLE001 - any unreadable body: fall back to the status text
        return str(exc.reason)
