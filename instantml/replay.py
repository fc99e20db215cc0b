"""Replaying a spool through the batch routes: the :class:`Replayer` that the background uploader
(:mod:`instantml.background`) and ``instantml sync`` (:mod:`instantml.sync`) both run.

Per spool file it reads whole lines after the acknowledged offset and sends them in file order: rank
events and ``run.log`` scalars in batches of their own route (each event with its ``event_id``), run
updates (config, finished: ``PATCH``) one by one with their ``event_id`` as ``Idempotency-Key``. It
appends the server's per-event rejects to ``rejects.jsonl``, and only then records the new offset. A
crash anywhere resends at most one batch, which the server answers with ``duplicate``: exactly once in
effect. A finished file (its writer's lock is gone) that is fully acknowledged is deleted; a torn last
line is reported and ignored.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instantml import limits, routes, spool, transport

log = logging.getLogger("instantml.replay")

#: Bytes of spool lines per batch: their batch body is smaller, so it stays under the 5 MiB limit.
BATCH_BYTES = 4 * 1024 * 1024


#: What a spool line may request, as (method, its path, where it is sent): rank events and scalars
#: through their batch routes, run updates (config, finished) one by one to the run's own route.
KINDS = (
    ("POST", routes.path_pattern(routes.RANK_METRICS), routes.RANK_METRICS_BATCH),
    ("POST", routes.path_pattern(routes.SCALARS), routes.SCALARS_BATCH),
    ("PATCH", routes.path_pattern(routes.RUN), routes.RUN),
)


def _destination(method: object, path: str) -> str | None:
    """Where a spool line's request is sent (a path), or None when this client sends no such request."""
    for kind_method, pattern, route in KINDS:
        found = pattern.match(path) if method == kind_method else None
        if found:
            return route.format(**found.groupdict())
    return None


class Stop(Exception):
    """Replay cannot go on: the server refuses this setup (token, project) or the deadline passed."""


@dataclass
class Line:
    raw: bytes
    end: int  # offset just after this line in its file
    event: dict[str, Any] | None  # the batch event (body + event_id), None if unreadable
    url_path: str = ""
    problem: str = ""
    method: str = "POST"  # POST: an event sent in a batch; PATCH: a run update sent alone


class Replayer:
    def __init__(
        self,
        spool_dir: Path,
        api_url: str,
        api_key: str,
        batch_events: int = limits.MAX_BATCH_EVENTS,
        give_up_after: float | None = None,
        on_progress: Callable[[Replayer], None] | None = None,
        on_retry: Callable[[Replayer, str, float], None] | None = None,
    ) -> None:
        self.dir = spool_dir
        self.api_url = api_url.rstrip("/")
        self.api_key = api_key
        self.batch_events = max(1, min(batch_events, limits.MAX_BATCH_EVENTS))
        self.give_up_after = give_up_after
        self.on_progress = on_progress
        #: Called after a transient failure, before the wait: with the URL tried and the wait (s).
        self.on_retry = on_retry
        self.stored = self.duplicate = self.rejected = self.torn = 0
        #: Run updates (config, finished) the server took.
        self.updated = 0
        #: Transient failures in a row, the last one's error, and the seconds left before giving up.
        self.failures = 0
        self.last_error = ""
        self.gives_up_in: float | None = None

    @property
    def done(self) -> int:
        return self.stored + self.duplicate + self.rejected + self.updated

    def drain(self, path: Path, finish: bool = True) -> bool:
        """Send everything ``path`` holds now. With ``finish``, delete it when its writer is gone and
        everything is acknowledged. Returns whether any line was sent."""
        sent = False
        while True:
            offset = spool.read_ack(path)
            chunk, tail = spool.read_lines(path, offset, BATCH_BYTES)
            if chunk.lines:
                self._send_chunk(path, chunk)
                sent = True
                continue
            if not finish or spool.writer_alive(path):
                return sent
            # The writer is gone: anything it wrote is in the file now. Read once more, then finish.
            chunk, tail = spool.read_lines(path, offset, BATCH_BYTES)
            if chunk.lines:
                continue
            if not path.exists():
                return sent
            if tail:
                self.torn += 1
                log.warning(
                    "ignored a torn last line (%d bytes) of %s: its writer died in the middle of a write",
                    tail,
                    path.name,
                )
            spool.remove(path)
            return sent

    def _parse(self, chunk: spool.Chunk) -> list[Line]:
        out: list[Line] = []
        end = chunk.start
        for raw in chunk.lines:
            end += len(raw)
            try:
                obj = json.loads(raw)
                method, path = obj.get("method"), obj["path"]
                url_path = _destination(method, path)
                if obj.get("v") != 1 or url_path is None:
                    raise ValueError(f"not a request event this client sends: {method} {path!r}")
                event = dict(obj["body"])
                event["event_id"] = str(obj["event_id"])
                out.append(Line(raw, end, event, url_path, method=method))
            except (ValueError, KeyError, TypeError) as exc:
                out.append(Line(raw, end, None, problem=f"unreadable spool line: {exc}"))
        return out

    def _send_chunk(self, path: Path, chunk: spool.Chunk) -> None:
        lines = self._parse(chunk)
        i = 0
        while i < len(lines):
            if lines[i].event is None:
                self._reject(path, [(lines[i], {"code": "unreadable_line", "message": lines[i].problem})])
                spool.write_ack(path, lines[i].end)
                i += 1
                continue
            if lines[i].method == "PATCH":  # a run update: alone, after the batches before it
                self._send_update(path, lines[i])
                spool.write_ack(path, lines[i].end)
                if self.on_progress:
                    self.on_progress(self)
                i += 1
                continue
            # The events up to the next run update or unreadable line (which must follow what came
            # before it), one batch per route of at most batch_events: rank events and run.log scalars
            # go to their own routes, so a rank that logs both still sends full batches. The window is
            # acknowledged once all of its batches are stored; a crash in between resends duplicates.
            batches: dict[str, list[Line]] = {}
            j = i
            while j < len(lines) and lines[j].event is not None and lines[j].method == "POST":
                batch = batches.setdefault(lines[j].url_path, [])
                if len(batch) == self.batch_events:
                    break
                batch.append(lines[j])
                j += 1
            for batch in batches.values():
                if batch:
                    self._send_batch(path, batch)
            spool.write_ack(path, lines[j - 1].end)
            if self.on_progress:
                self.on_progress(self)
            i = j

    def _send_batch(self, path: Path, batch: list[Line]) -> None:
        url = self.api_url + batch[0].url_path
        body = json.dumps({"events": [line.event for line in batch]}, allow_nan=False).encode()
        started = time.monotonic()
        while True:
            try:
                result = transport.post_batch(url, self.api_key, body)
            except transport.Transient as exc:
                self._retry_later(exc, started, url, f"batch of {len(batch)}")
                continue
            except transport.Refused as exc:
                if exc.about_setup:
                    raise Stop(f"the server at {url} refuses this spool's requests: {exc}") from None
                if len(batch) > 1:  # find the culprit: send the events one by one
                    for line in batch:
                        self._send_batch(path, [line])
                    return
                self._reject(path, [(batch[0], exc.error)])
                return
            self.failures = 0
            self.stored += result.stored
            self.duplicate += result.duplicate
            if result.rejected:
                by_id = {line.event["event_id"]: line for line in batch if line.event is not None}
                self._reject(
                    path,
                    [
                        (by_id[r["event_id"]], r.get("error") or {})
                        for r in result.rejected
                        if r.get("event_id") in by_id
                    ],
                )
            return

    def _send_update(self, path: Path, line: Line) -> None:
        """Send one run update (``PATCH`` of the run) with its event id as ``Idempotency-Key``, retrying
        transient failures as batches are. A 401/403 stops the replay; any other 4xx (an older server
        without the route included) is a reject, so the events behind it still go."""
        assert line.event is not None
        event_id = line.event["event_id"]
        update = {k: v for k, v in line.event.items() if k != "event_id"}
        url = self.api_url + line.url_path
        started = time.monotonic()
        while True:
            try:
                transport.patch_run(url, self.api_key, update, event_id)
            except transport.Transient as exc:
                self._retry_later(exc, started, url, "run update")
                continue
            except transport.Refused as exc:
                if exc.status in transport.AUTH_STATUSES:
                    raise Stop(f"the server at {url} refuses this spool's requests: {exc}") from None
                self._reject(path, [(line, exc.error)])
                return
            self.failures = 0
            self.updated += 1
            return

    def _retry_later(self, exc: transport.Transient, started: float, url: str, what: str) -> None:
        """Count a transient failure and wait before the next attempt (or give up: :class:`Stop`, naming
        the URL). The wait never runs past the point of giving up."""
        self.failures += 1
        self.last_error = str(exc)
        delay = transport.backoff(self.failures, exc.retry_after)
        if self.give_up_after is not None:
            left = self.give_up_after - (time.monotonic() - started)
            if left <= 0:
                raise Stop(
                    f"{url} has not taken events for {self.give_up_after:.0f} s (last error: {exc})"
                ) from None
            delay = min(delay, left)
            self.gives_up_in = left
        log.info("%s to %s not sent (%s); retrying in %.1f s", what, url, exc, delay)
        if self.on_retry:
            self.on_retry(self, url, delay)
        time.sleep(delay)

    def _reject(self, path: Path, rows: list[tuple[Line, dict[str, Any]]]) -> None:
        records = []
        for line, error in rows:
            try:
                event: Any = json.loads(line.raw)
            except ValueError:
                event = line.raw.decode("utf-8", "replace")
            records.append({"file": path.name, "error": error, "event": event, "rejected_at": time.time()})
            log.warning("event rejected (%s): %s", path.name, error.get("message", error))
        spool.append_rejects(self.dir, records)
        self.rejected += len(rows)
