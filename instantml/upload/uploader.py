"""The in-process upload mode: a background thread sends batches through the batch routes.

The training thread only appends to a deque. The thread lets events wait for more, up to the bounds of
``limits.UPLOAD_LINGER_S`` (10 s or ``batch_size`` events; everything at ``finish`` or exit), then sends,
in logged order, rank events and ``run.log`` scalars in batches (each event with its id inside the
batch) and run updates (config, finished) one by one with their id as ``Idempotency-Key``, so a retry
after a lost response stores nothing twice. The rules are those of the spool's uploader
(``transport``): transient failures (network, 429, 5xx) are retried with exponential backoff and
jitter, honouring ``Retry-After``; per-event rejects are logged with the server's reason. A request
that fails transiently waits for its next attempt while the ones behind it go on (a run update still
waits for the events logged before it), and one the server keeps failing on while it takes others is
set aside (``transport.Attempts.poison``) into ``set-aside.jsonl`` of the spool directory
(``INSTANTML_SPOOL_DIR``, default ``.instantml/spool``), from where ``instantml sync --resend-set-aside``
sends it again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import quote

from instantml import limits, routes, settings
from instantml.upload import spool, transport

log = logging.getLogger("instantml")


#: The kinds of request the queue holds, each sent to its own route: rank events and scalars in batches,
#: run updates (``PATCH`` of the run) one by one.
RANK, SCALARS, RUN_UPDATE = 0, 1, 2


class ThreadUploader:
    def __init__(
        self,
        api_url: str,
        api_key: str,
        project: str,
        run_id: str,
        batch_size: int = 500,
        world_size: int | None = None,
    ) -> None:
        """``world_size``: the job's, as its launcher set it, which spreads the first uploads of its
        ranks (``transport.first_upload_spread_s``)."""
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
        #: Set by ``flush``: everything waiting goes now (a signal or an exception ends the process next).
        self._urgent = False
        self._wake = threading.Event()
        self.stored = 0
        self.duplicate = 0
        self.updated = 0
        self.rejected: list[dict[str, Any]] = []
        self.fatal: str | None = None
        #: Requests that failed transiently and wait for another attempt, in logged order; while one
        #: waits, the others go on (at most transport.MAX_HELD wait at once).
        self._held: list[_Item] = []
        self._lock = threading.Lock()
        self._health = transport.Health()
        self._rule = transport.PoisonRule.from_env()
        #: How long events wait for more (``limits.UPLOAD_LINGER_S``), and since when the oldest one
        #: waiting has waited (``time.monotonic()`` as this thread first saw it; None: none waits).
        self._linger = transport.linger_s(api_url)
        self._since: float | None = None
        #: Before the server has taken a request, events go at once from this time on (a random point
        #: of the job's spread; a flush, the end or a full batch do not wait for it).
        spread = transport.first_upload_spread_s(api_url, world_size)
        self._first_at = time.monotonic() + random.uniform(0.0, spread)
        #: Reasons of the requests set aside (see transport.Attempts.poison), and where they are written.
        self.set_aside: list[str] = []
        self._api_url = api_url
        self._set_aside_dir = Path(os.environ.get(settings.SPOOL_DIR_ENV) or settings.DEFAULT_SPOOL_DIR)
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

    def flush(self, timeout: float) -> None:
        """Send what waits now and wait at most ``timeout`` seconds until the server has it (the process is
        about to end: a signal, an exception), without stopping the thread."""
        self._urgent = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while (self._pending or self._held) and self._thread.is_alive() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)

    def close(self, timeout: float) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:
            held = list(self._held)
        left = len(self._pending) + sum(len(item.bodies) for item in held)
        if self.fatal:
            log.error("instantml: %s were not uploaded: %s", self._counted(held), self.fatal)
            return
        if self.set_aside:
            log.warning(
                "instantml: %d request(s) were set aside in %s: %s. They are kept, not sent; once the "
                "server is fixed: instantml sync %s --resend-set-aside",
                len(self.set_aside),
                self._set_aside_dir / spool.SET_ASIDE,
                self.set_aside[-1],
                self._set_aside_dir,
            )
        if not left:
            return
        failing = [item for item in held if item.attempts.server_errors]
        if failing and self._health.successes > 0 and not self._pending and len(failing) == len(held):
            # Everything else is stored: only requests the server fails on are left. This process
            # ends, so they go where a person can resend them rather than vanish.
            for item in failing:
                self._set_aside(item, at_close=True)
            return
        if held and self._health.successes and any(i.attempts.others_succeeded(self._health) for i in held):
            why = held[0].attempts.describe(self._health)
            log.warning(
                "instantml: %s still pending after %.0f s; the server is up (it took other "
                "requests) but failed on %s: %s. Use upload_mode='spool' to keep events on disk across "
                "restarts.",
                self._counted(held),
                timeout,
                held[0].what,
                why,
            )
            return
        log.warning(
            "instantml: %s still pending after %.0f s; the server may be down%s. "
            "Use upload_mode='spool' to keep events on disk across restarts.",
            self._counted(held),
            timeout,
            f" (last error: {held[0].attempts.last_error})" if held else "",
        )

    def _counted(self, held: list[_Item]) -> str:
        """What is left, in words: ``3 event(s)``, and the run updates (config, end, process records)
        apart, as they are not events."""
        updates = sum(kind == RUN_UPDATE for kind, _ in self._pending)
        updates += sum(len(item.bodies) for item in held if item.kind == RUN_UPDATE)
        events = len(self._pending) + sum(len(item.bodies) for item in held) - updates
        return spool.counted(events, updates)

    @property
    def pending(self) -> int:
        return len(self._pending) + sum(len(item.bodies) for item in self._held)

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            try:
                worked = self._retry_held(now)
                if self._take_pending(now):
                    continue
            except transport.Refused as exc:
                self.fatal = str(exc)
                log.error("instantml: upload stopped: %s", exc)
                return
            if not self._pending and not self._held:
                if self._closing.is_set():
                    return
                self._wake.wait(0.25)
                self._wake.clear()
                continue
            if not worked:
                self._wait_until_due(now)

    def _retry_held(self, now: float) -> bool:
        """Attempt each held request whose next attempt is due; whether any of them settled."""
        worked = False
        for item in list(self._held):
            due = now >= item.attempts.next_attempt and now >= self._health.not_before
            if due and item in self._held and self._may_attempt(item):
                worked = self._attempt(item) or worked
        return worked

    def _take_pending(self, now: float) -> bool:
        """When the waiting events are due and there is room to hold more, batch them up and send each
        batch once; whether they were taken."""
        if not (
            self._pending
            and len(self._held) < transport.MAX_HELD
            and time.monotonic() >= self._health.not_before
            and self._due(now)
        ):
            return False
        taken, batches = self._window()
        for _ in range(taken):
            self._pending.popleft()
        if not self._pending:
            self._since = None  # (what is left waited already: it goes next)
        for kind, batch in batches.items():
            item = _Item(kind, batch)
            with self._lock:
                self._held.append(item)
            if self._may_attempt(item):
                self._attempt(item)
        return True

    def _wait_until_due(self, now: float) -> None:
        """Sleep until the next held attempt or the end of the linger, at most 0.25 s (a full batch or a
        close wakes it sooner)."""
        times = [i.attempts.next_attempt for i in self._held]
        if self._pending and self._since is not None:
            times.append(self._since + self._linger)
        wait = max(min(times, default=now + 0.25), self._health.not_before) - time.monotonic()
        self._wake.wait(min(0.25, max(0.001, wait)))
        self._wake.clear()

    def _due(self, now: float) -> bool:
        """Whether the waiting events go now (the bounds of ``limits.UPLOAD_LINGER_S``): at the end, a
        full batch, until the server has taken a request, or once the oldest has waited the linger."""
        if (
            self._closing.is_set()
            or self._urgent
            or (self._health.successes == 0 and now >= self._first_at)
            or len(self._pending) >= self._batch_size
        ):
            return True
        if self._since is None:
            self._since = now
        return now - self._since >= self._linger

    def _may_attempt(self, item: _Item) -> bool:
        """A run update waits for every held event batch before it and for held updates of the same
        fields; it passes a held update of other fields (a ``finished`` mark passing a ``config``) only
        once that update failed again after the server took other requests (``Attempts.suspect``), so
        updates keep their order through an outage and its end. Events never wait."""
        if item.kind != RUN_UPDATE:
            return True
        for earlier in self._held:
            if earlier is item:
                return True
            if earlier.kind != RUN_UPDATE or earlier.fields & item.fields:
                return False
            if not earlier.attempts.suspect:
                return False
        return True

    def _attempt(self, item: _Item) -> bool:
        """Send one held request; returns whether it is settled (stored, rejected or set aside). A
        refused token raises :class:`transport.Refused`."""
        try:
            if item.kind == RUN_UPDATE:
                self._update(item.bodies[0])
            else:
                self._send(self._urls[item.kind], item.bodies)
        except transport.Transient as exc:
            delay = item.attempts.failed(exc, self._health)
            if item.attempts.poison(self._rule, self._health):
                self._set_aside(item)
                return True
            log.info("instantml: %s not sent (%s); retrying in %.1f s", item.what, exc, delay)
            return False
        self._health.succeeded()
        with self._lock:
            self._held.remove(item)
        return True

    def _set_aside(self, item: _Item, at_close: bool = False) -> None:
        """A request the server keeps failing on while it takes others (``transport.Attempts.poison``):
        a batch is split into its events, each to fail again before it is set aside; a single request
        is written to ``set-aside.jsonl`` of the spool directory, in the spool's format, so that
        ``instantml sync --resend-set-aside`` can send it again."""
        if len(item.bodies) > 1 and not at_close:
            singles = []
            for body in item.bodies:
                single = _Item(item.kind, [body])
                single.attempts = transport.Attempts(
                    failures=item.attempts.failures,
                    server_errors=self._rule.attempts - 1,
                    first_server_error=time.monotonic() - self._rule.seconds,
                    successes_before=self._health.successes,
                    last_status=item.attempts.last_status,
                )
                singles.append(single)
            with self._lock:
                at = self._held.index(item)
                self._held[at : at + 1] = singles
            return
        why = item.attempts.describe(self._health)
        reason = (
            f"set aside {'at finish ' if at_close else ''}after {item.attempts.server_errors} attempts: "
            f"{why}; the server took others, so this request looks refused by it for good"
        )
        route = self._urls[item.kind][len(self._api_url) :]
        method = "PATCH" if item.kind == RUN_UPDATE else "POST"
        if item.kind != RUN_UPDATE:
            route = route[: -len("/batch")]
        rows = []
        for body in item.bodies:
            event = {
                "v": 1,
                "event_id": body["event_id"],
                "method": method,
                "path": route,
                "body": {k: v for k, v in body.items() if k != "event_id"},
                "created": time.time(),
            }
            rows.append(
                {
                    "file": f"thread@pid{os.getpid()}",
                    "reason": reason,
                    "status": item.attempts.last_status,
                    "attempts": item.attempts.server_errors,
                    "last_error": item.attempts.last_error,
                    "event": event,
                    "set_aside_at": time.time(),
                }
            )
        where = self._set_aside_dir / spool.SET_ASIDE
        try:
            self._set_aside_dir.mkdir(parents=True, exist_ok=True)
            spool.append_rows(self._set_aside_dir, spool.SET_ASIDE, rows)
        except OSError as exc:
            log.error("instantml: cannot write %s (%s); the request set aside was: %s", where, exc, rows)
        self.set_aside.append(f"{item.what}: {why}")
        log.error(
            "instantml: %s set aside in %s: %s. Resend it with: instantml sync %s --resend-set-aside",
            item.what,
            where,
            reason,
            self._set_aside_dir,
        )
        with self._lock:
            if item in self._held:
                self._held.remove(item)

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


class _Item:
    """Requests of one kind on their way: a batch of events, or one run update, with its failed
    attempts."""

    def __init__(self, kind: int, bodies: list[dict[str, Any]]) -> None:
        self.kind = kind
        self.bodies = bodies
        self.attempts = transport.Attempts()

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(self.bodies[0]) - {"event_id", "time"}

    @property
    def what(self) -> str:
        if self.kind == RUN_UPDATE:
            return "run update (" + ", ".join(sorted(self.fields)) + ")"
        return f"batch of {len(self.bodies)} event(s)"
