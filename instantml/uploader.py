"""The in-process upload mode: a background thread sends batches through the batch routes.

The training thread only appends to a deque. The thread sends, in logged order, rank events and
``run.log`` scalars in batches (each event with its id inside the batch) and run updates (config,
finished) one by one with their id as ``Idempotency-Key``, so a retry after a lost response stores
nothing twice. The rules are those of the spool's uploader
(``transport``): transient failures (network, 429, 5xx) are retried with exponential backoff and
jitter, honouring ``Retry-After``; per-event rejects are logged with the server's reason.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import quote

from instantml import limits, routes, transport

log = logging.getLogger("instantml")


#: The kinds of request the queue holds, each sent to its own route: rank events and scalars in batches,
#: run updates (``PATCH`` of the run) one by one.
RANK, SCALARS, RUN_UPDATE = 0, 1, 2


class ThreadUploader:
    def __init__(self, api_url: str, api_key: str, project: str, run_id: str, batch_size: int = 500) -> None:
        names = {"project": quote(project, safe=""), "run_id": quote(run_id, safe="")}
        self._urls = {
            RANK: api_url + routes.RANK_METRICS_BATCH.format(**names),
            SCALARS: api_url + routes.SCALARS_BATCH.format(**names),
            RUN_UPDATE: api_url + routes.RUN.format(**names),
        }
        self._key = api_key
        self._batch_size = max(1, min(batch_size, limits.MAX_BATCH_EVENTS))
        #: (kind, body) in the order they were logged; each body carries its ``event_id``.
        self._pending: deque[tuple[int, dict[str, Any]]] = deque()
        self._closing = threading.Event()
        self._wake = threading.Event()
        self.stored = 0
        self.duplicate = 0
        self.updated = 0
        self.rejected: list[dict[str, Any]] = []
        self.fatal: str | None = None
        self._thread = threading.Thread(target=self._loop, name="instantml-uploader", daemon=True)
        self._thread.start()

    def log(
        self,
        values: dict[str, float],
        step: int,
        rank: int,
        world_size: int,
        local_rank: int | None,
        weight: float,
    ) -> None:
        body: dict[str, Any] = {
            "event_id": os.urandom(16).hex(),
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "weight": weight,
            "metrics": {k: limits.wire_value(v) for k, v in values.items()},
            "time": time.time(),
        }
        if local_rank is not None:
            body["local_rank"] = local_rank
        self._pending.append((RANK, body))
        if len(self._pending) >= self._batch_size:
            self._wake.set()

    def log_scalars(self, values: dict[str, float], step: int, rank: int) -> None:
        body = {
            "event_id": os.urandom(16).hex(),
            "step": step,
            "rank": rank,
            "metrics": {k: limits.wire_value(v) for k, v in values.items()},
            "time": time.time(),
        }
        self._pending.append((SCALARS, body))
        if len(self._pending) >= self._batch_size:
            self._wake.set()

    def update_run(self, body: dict[str, Any]) -> None:
        self._pending.append((RUN_UPDATE, {"event_id": os.urandom(16).hex(), **body}))

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
            taken, batches = self._window()
            try:
                for kind, batch in batches.items():
                    if kind == RUN_UPDATE:
                        self._update(batch[0])
                    else:
                        self._send(self._urls[kind], batch)
            except transport.Refused as exc:
                self.fatal = str(exc)
                log.error("instantml: upload stopped: %s", exc)
                return
            except transport.Transient as exc:
                failures += 1
                delay = transport.backoff(failures, exc.retry_after)
                log.info("instantml: upload failed (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                continue
            failures = 0
            for _ in range(taken):
                self._pending.popleft()

    def _window(self) -> tuple[int, dict[int, list[dict[str, Any]]]]:
        """The next items to send: a run update alone, else the events up to the next run update (which
        must follow what was logged before it), as one batch per route of at most ``batch_size`` each.
        Rank events and ``run.log`` scalars go to their own routes, so a rank that logs both still sends
        full batches. Returns how many items of ``_pending`` the window holds."""
        if self._pending[0][0] == RUN_UPDATE:
            return 1, {RUN_UPDATE: [self._pending[0][1]]}
        batches: dict[int, list[dict[str, Any]]] = {}
        taken = 0
        for i in range(len(self._pending)):  # by index: the training thread appends meanwhile
            kind, body = self._pending[i]
            batch = batches.setdefault(kind, [])
            if kind == RUN_UPDATE or len(batch) == self._batch_size:
                break
            batch.append(body)
            taken += 1
        return taken, {kind: batch for kind, batch in batches.items() if batch}

    def _send(self, url: str, batch: list[dict[str, Any]]) -> None:
        data = json.dumps({"events": batch}, allow_nan=False).encode()
        try:
            result = transport.post_batch(url, self._key, data)
        except transport.Refused as exc:
            if exc.about_setup or len(batch) == 1:
                if not exc.about_setup:
                    self._rejected([{"event_id": batch[0]["event_id"], "error": exc.error}])
                    return
                raise
            for event in batch:  # one bad event must not hold back the others
                self._send(url, [event])
            return
        self.stored += result.stored
        self.duplicate += result.duplicate
        self._rejected(result.rejected)

    def _update(self, event: dict[str, Any]) -> None:
        update = {k: v for k, v in event.items() if k != "event_id"}
        try:
            transport.patch_run(self._urls[RUN_UPDATE], self._key, update, event["event_id"])
        except transport.Refused as exc:
            if exc.status in transport.AUTH_STATUSES:
                raise
            self._rejected([{"event_id": event["event_id"], "error": exc.error}])
            return
        self.updated += 1

    def _rejected(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            self.rejected.append(item)
            log.warning("instantml: event %s rejected: %s", item.get("event_id"), item.get("error"))
