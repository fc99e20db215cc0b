"""Replaying a spool through the batch routes: the :class:`Replayer` that the background uploader
(:mod:`instantml.upload.background`) and ``instantml sync`` (:mod:`instantml.commands.sync`) both run.

Per spool file it reads whole lines after the acknowledged offset and sends them in file order (the
background uploader lets a live writer's lines wait for more first: ``linger_s``, the bounds of
``limits.UPLOAD_LINGER_S``; ``instantml sync`` sends at once): rank
events and ``run.log`` scalars in batches of their own route (each event with its ``event_id``), run
updates (config, finished: ``PATCH``) one by one with their ``event_id`` as ``Idempotency-Key``. It
appends the server's per-event rejects to ``rejects.jsonl``, and only then records the new offset. A
crash anywhere resends at most what was sent since the recorded offset, which the server answers with
``duplicate``: exactly once in effect. A finished file (its writer's lock is gone) that is fully
acknowledged is deleted; a torn last line is reported and ignored.

A request that fails transiently is *held*: it waits for its next attempt (backoff, jitter,
``Retry-After``) while the lines behind it go on, up to ``transport.MAX_HELD`` held requests. The
recorded offset stays at the first held request's line, so nothing held is ever skipped by a restart.
Order: a run update is sent only once every event before it in its file is settled (stored, rejected
or set aside) and after every earlier update of the same fields (``config`` after ``config``; a
``finished`` mark does not wait for a ``config`` update that keeps failing). A request the server
keeps failing on while it takes others is set aside by ``transport.Attempts.poison`` into
``set-aside.jsonl``, never dropped.

A disk that refuses the progress record or the rejects file (full, quota) stops nothing: progress is
kept in memory and written when the disk takes it again, rejects wait in memory, and a file is not
deleted before they are written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from instantml import limits
from instantml.upload import spool, transport
from instantml.upload.replay_requests import Held, Line, Writer, may_attempt, parse, writer_of

log = logging.getLogger("instantml.upload.replay")

#: Bytes of spool lines per batch: their batch body is smaller, so it stays under the 5 MiB limit.
BATCH_BYTES = 4 * 1024 * 1024


class Stop(Exception):
    """Replay cannot go on: the server refuses this setup (token, project) or the deadline passed."""


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
        linger_s: float = 0.0,
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
        #: Run updates (config, finished) the server took; requests set aside (see transport.Attempts).
        self.updated = 0
        self.set_aside = 0
        self.set_aside_reasons: list[str] = []
        #: Transient failures in a row, the last one's error, and the seconds left before giving up.
        self.failures = 0
        self.last_error = ""
        self.gives_up_in: float | None = None
        self.rule = transport.PoisonRule.from_env()
        self.health = transport.Health()
        self.held: dict[Path, list[Held]] = {}
        #: Per file: the offset up to which every line was sent (or is held).
        self._sent: dict[Path, int] = {}
        #: Rows for the rejects and set-aside files that the disk has not taken yet.
        self._unwritten: list[tuple[str, dict[str, Any]]] = []
        #: The last disk error writing progress or rejects (None: the disk takes them), and when to try
        #: again.
        self.disk_error: str | None = None
        self._disk_retry_at = 0.0
        self._disk_failures = 0
        #: How long a live writer's lines wait for more (``limits.UPLOAD_LINGER_S``; 0: never, as
        #: ``instantml sync`` sends), and per file since when its oldest unsent line has waited.
        self.linger_s = linger_s
        self._waiting: dict[Path, float] = {}
        #: Per file: what its lines said of their writer (contract 8), to report one gone without an end.
        self._writers: dict[Path, Writer] = {}
        #: Writers reported gone without an ``ended`` record (``how: vanished``).
        self.gone = 0

    @property
    def done(self) -> int:
        return self.stored + self.duplicate + self.rejected + self.updated + self.set_aside

    @property
    def holding(self) -> int:
        """Requests waiting for another attempt."""
        return sum(len(items) for items in self.held.values())

    def next_attempt(self) -> float:
        """``time.monotonic()`` of the next held request's attempt (now if none is held)."""
        times = [h.attempts.next_attempt for items in self.held.values() for h in items]
        return max(self.health.not_before, min(times, default=time.monotonic()))

    def held_report(self) -> list[dict[str, Any]]:
        return [
            {"file": path.name, "what": h.what, "why": h.attempts.describe(self.health)}
            for path, items in self.held.items()
            for h in items
        ]

    def drain_all(self) -> None:
        """Every file of the spool, then again while requests wait for another attempt, until each is
        settled (stored, rejected, set aside) or :class:`Stop` (the deadline, a refused token)."""
        while True:
            progressed = False
            files = spool.spool_files(self.dir)
            for path in files:
                progressed = self.drain(path) or progressed
            if not self.holding:
                # Finished files still there after a pass that moved something, or that came meanwhile
                # (a report of a writer gone without an end, this replayer's or another uploader's): one
                # more pass. (A disk refusing progress records stops nothing: sync says so.)
                left = [p for p in spool.spool_files(self.dir) if not spool.writer_alive(p)]
                if not left or not (progressed or set(left) - set(files)):
                    return
                continue
            if not progressed:
                time.sleep(min(1.0, max(0.01, self.next_attempt() - time.monotonic())))

    def _may_send_new(self) -> bool:
        return self.holding < transport.MAX_HELD and time.monotonic() >= self.health.not_before

    def drain(self, path: Path, finish: bool = True) -> bool:
        """Send everything ``path`` holds now (held requests whose time has come, then new lines).
        With ``finish``, delete it when its writer is gone and everything is settled. Returns whether
        any request was sent or settled."""
        sent = self._retry_held(path)
        while True:
            start = max(spool.read_ack(path), self._sent.get(path, 0))
            if not self._may_send_new() or not self._due(path, start):
                self._record(path)
                return sent
            chunk, tail = spool.read_lines(path, start, BATCH_BYTES)
            if chunk.lines:
                self._waiting.pop(path, None)
                if self._send_chunk(path, chunk):
                    sent = True
                self._record(path)
                continue
            self._record(path)
            if self.held.get(path) or not finish or spool.writer_alive(path):
                return sent
            # The writer is gone: anything it wrote is in the file now. Read once more, then finish.
            chunk, tail = spool.read_lines(path, start, BATCH_BYTES)
            if chunk.lines:
                continue
            if not path.exists():
                self._forget(path)
                return sent
            # Rejects not on disk yet, or the report of a writer gone without an end: keep the file, so
            # they can be redone.
            if not self._flush() or not self._report_gone(path):
                return sent
            if tail:
                self.torn += 1
                log.warning(
                    "ignored a torn last line (%d bytes) of %s: its writer died in the middle of a write",
                    tail,
                    path.name,
                )
            spool.remove(path)
            self._forget(path)
            return sent

    def _report_gone(self, path: Path) -> bool:
        """Before a finished file is deleted: if its writer said who it is but not that it ended (a
        SIGKILL, the OOM killer, ``os._exit``), leave the record of its end in a new spool file, dated at
        the file's last write, for the server to name it at once (contract 8). False if the disk refuses
        it (the file is kept, to try again)."""
        writer = self._writers.get(path)
        pid = spool.writer_pid(path)  # a training process's own file: not a resend, not a report
        if pid is None:
            return True
        if writer is None:  # another uploader sent its lines: read its process records again
            writer = writer_of(path, spool.read_ack(path))
        if writer.who is None or writer.who.get("pid") != pid:
            return True
        try:
            # One id per file: a second report of it (an uploader and a sync, a crash before the file
            # was deleted) is the same event.
            event_id = hashlib.sha256(path.name.encode()).hexdigest()[:32]
            line = writer.gone_report(path.stat().st_mtime, event_id)
            if line is None:
                return True
            spool.write_finished(self.dir, path.name.removesuffix(spool.SUFFIX) + "-gone", [line])
        except OSError as exc:
            self._disk_refused(exc, "the report of a writer gone without an end")
            return False
        self.gone += 1
        log.warning(
            "the writer of %s (rank %s, pid %s) is gone without recording its end: reported as vanished",
            path.name,
            (writer.who or {}).get("rank"),
            (writer.who or {}).get("pid"),
        )
        return True

    def _forget(self, path: Path) -> None:
        self._writers.pop(path, None)
        self._sent.pop(path, None)
        self.held.pop(path, None)
        self._waiting.pop(path, None)

    def _due(self, path: Path, start: int) -> bool:
        """Whether the lines of ``path`` after ``start`` go now (the bounds of ``limits.UPLOAD_LINGER_S``):
        with no linger, until the server has taken a request, once ``UPLOAD_BATCH_BYTES`` wait, once the
        oldest has waited the linger, or when the file's writer is gone (it will write no more)."""
        if self.linger_s <= 0 or self.health.successes == 0:
            return True
        try:
            waiting = path.stat().st_size - start
        except OSError:
            return True
        if waiting <= 0 or waiting >= limits.UPLOAD_BATCH_BYTES:
            return True
        since = self._waiting.setdefault(path, time.monotonic())
        return time.monotonic() - since >= self.linger_s or not spool.writer_alive(path)

    def _send_chunk(self, path: Path, chunk: spool.Chunk) -> bool:
        """Send the chunk's lines in order until too many requests are held; returns whether any line
        was taken."""
        lines = parse(chunk)
        if path not in self._writers:  # what came before this uploader's first line is read again
            self._writers[path] = writer_of(path, chunk.start) if chunk.start else Writer()
        self._writers[path].note(lines)
        held = self.held.setdefault(path, [])
        i = 0
        while i < len(lines) and self._may_send_new():
            if lines[i].event is None:
                self._reject(path, [(lines[i], {"code": "unreadable_line", "message": lines[i].problem})])
                self._sent[path] = lines[i].end
                i += 1
                continue
            if lines[i].method == "PATCH":  # a run update: alone, after the events before it
                item = Held([lines[i]])
                held.append(item)
                if may_attempt(held, item, self.health):
                    self._attempt(path, item)
                self._sent[path] = lines[i].end
                i += 1
                self._record(path)
                self._progress()
                continue
            # The events up to the next run update or unreadable line (which must follow what came
            # before it), one batch per route of at most batch_events: rank events and run.log scalars
            # go to their own routes, so a rank that logs both still sends full batches.
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
                    item = Held(batch)
                    held.append(item)
                    self._attempt(path, item)
            self._sent[path] = lines[j - 1].end
            i = j
            self._record(path)
            self._progress()
        return i > 0

    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress(self)

    def _retry_held(self, path: Path) -> bool:
        """Attempt the held requests of ``path`` whose time has come (in order). Returns whether any was
        settled."""
        settled = False
        held = self.held.get(path, [])
        for item in list(held):
            now = time.monotonic()
            if item not in held or now < item.attempts.next_attempt or now < self.health.not_before:
                continue
            if may_attempt(held, item, self.health):
                settled = self._attempt(path, item) or settled
        if settled:
            self._record(path)
            self._progress()
        return settled

    def _attempt(self, path: Path, item: Held) -> bool:
        """Send one request (held in ``self.held[path]``, where it stays if it fails transiently).
        Returns whether it was settled: stored, rejected or set aside."""
        held = self.held[path]
        url = self.api_url + item.lines[0].url_path
        try:
            if item.update:
                self._send_update(item.lines[0], url)
            else:
                self._send_batch(path, item, url)
        except transport.Transient as exc:
            delay = item.attempts.failed(exc, self.health)
            self.failures, self.last_error = item.attempts.failures, str(exc)
            if item.attempts.poison(self.rule, self.health):
                self._set_aside(path, item)
                return True
            self._give_up_maybe(item, url, exc)
            log.info("%s to %s not sent (%s); retrying in %.1f s", item.what, url, exc, delay)
            if self.on_retry:
                self.on_retry(self, url, delay)
            return False
        except transport.Refused as exc:
            if exc.status in transport.AUTH_STATUSES or (not item.update and exc.about_setup):
                raise Stop(f"the server at {url} refuses this spool's requests: {exc}") from None
            if len(item.lines) > 1:  # find the culprit: send the events one by one
                self._split(path, item, transport.Attempts())
                return True
            self._reject(path, [(item.lines[0], exc.error)])
            held.remove(item)
            return True
        self.health.succeeded()
        self.failures = 0
        held.remove(item)
        return True

    def _split(self, path: Path, item: Held, attempts: transport.Attempts) -> None:
        """Replace a held batch by its events, one request each, attempted now in order."""
        held = self.held[path]
        at = held.index(item)
        singles = [Held([line], transport.Attempts(**vars(attempts))) for line in item.lines]
        held[at : at + 1] = singles
        for single in singles:
            self._attempt(path, single)

    def _send_batch(self, path: Path, item: Held, url: str) -> None:
        batch = item.lines
        body = json.dumps({"events": [line.event for line in batch]}, allow_nan=False).encode()
        result = transport.post_batch(url, self.api_key, body)
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

    def _send_update(self, line: Line, url: str) -> None:
        """Send one run update (``PATCH`` of the run) with its event id as ``Idempotency-Key``. A
        401/403 stops the replay; any other 4xx (an older server without the route included) is a
        reject, so the events behind it still go."""
        assert line.event is not None
        update = {k: v for k, v in line.event.items() if k != "event_id"}
        transport.patch_run(url, self.api_key, update, line.event["event_id"])
        self.updated += 1

    def _set_aside(self, path: Path, item: Held) -> None:
        """A request the server keeps failing on while it takes others (``transport.Attempts.poison``):
        a batch is split into its events (the healthy ones are stored now, the culprit is found); a
        single request goes to ``set-aside.jsonl`` with the reason, and the replay goes on."""
        attempts = item.attempts
        if len(item.lines) > 1:
            # Each event must fail again, after more of the server's successes, to be set aside.
            fresh = transport.Attempts(
                failures=attempts.failures,
                server_errors=self.rule.attempts - 1,
                first_server_error=time.monotonic() - self.rule.seconds,
                successes_before=self.health.successes,
                first_failure=attempts.first_failure,
                last_error=attempts.last_error,
                last_status=attempts.last_status,
            )
            self._split(path, item, fresh)
            return
        why = attempts.describe(self.health)
        line = item.lines[0]
        try:
            event: Any = json.loads(line.raw)
        except ValueError:
            event = line.raw.decode("utf-8", "replace")
        reason = (
            f"set aside after {attempts.server_errors} attempts: {why}; the server took others, so this "
            f"request looks refused by it for good"
        )
        row = {
            "file": path.name,
            "reason": reason,
            "status": attempts.last_status,
            "attempts": attempts.server_errors,
            "last_error": attempts.last_error,
            "event": event,
            "set_aside_at": time.time(),
        }
        self._unwritten.append((spool.SET_ASIDE, row))
        self._flush()
        self.set_aside += 1
        self.set_aside_reasons.append(f"{item.what}: {why}")
        log.error(
            "%s of %s set aside in %s: %s. Resend it with: instantml sync %s --resend-set-aside",
            item.what,
            path.name,
            self.dir / spool.SET_ASIDE,
            reason,
            self.dir,
        )
        self.held[path].remove(item)

    def _give_up_maybe(self, item: Held, url: str, exc: transport.Transient) -> None:
        if self.give_up_after is None or item.attempts.first_failure is None:
            return
        left = self.give_up_after - (time.monotonic() - item.attempts.first_failure)
        self.gives_up_in = left
        if left <= 0:
            raise Stop(f"{url} has not taken events for {self.give_up_after:.0f} s (last error: {exc})")
        item.attempts.next_attempt = min(item.attempts.next_attempt, time.monotonic() + left)

    def _reject(self, path: Path, rows: list[tuple[Line, dict[str, Any]]]) -> None:
        for line, error in rows:
            try:
                event: Any = json.loads(line.raw)
            except ValueError:
                event = line.raw.decode("utf-8", "replace")
            record = {"file": path.name, "error": error, "event": event, "rejected_at": time.time()}
            self._unwritten.append((spool.REJECTS, record))
            log.warning("event rejected (%s): %s", path.name, error.get("message", error))
        self.rejected += len(rows)
        self._flush()

    # --- the disk: progress and rejects, kept in memory while it refuses them ---------------------

    def _disk_refused(self, exc: OSError, what: str) -> None:
        self._disk_failures += 1
        self._disk_retry_at = time.monotonic() + transport.backoff(self._disk_failures, None)
        if self.disk_error is None:
            log.error(
                "cannot write %s in %s (%s); keeping it in memory and trying again: nothing is lost "
                "unless this process dies, and then the events are sent again from the spool",
                what,
                self.dir,
                exc,
            )
        self.disk_error = f"{what}: {exc}"

    def _disk_ok(self) -> None:
        if self.disk_error is not None:
            log.info("the disk takes writes again in %s", self.dir)
        self.disk_error = None
        self._disk_failures = 0

    def _flush(self) -> bool:
        """Write the rejects and set-aside rows that wait; False if the disk refuses them (still)."""
        if not self._unwritten:
            return True
        if time.monotonic() < self._disk_retry_at:
            return False
        by_file: dict[str, list[dict[str, Any]]] = {}
        for name, row in self._unwritten:
            by_file.setdefault(name, []).append(row)
        try:
            for name, rows in by_file.items():
                spool.append_rows(self.dir, name, rows)
                self._unwritten = [(n, r) for n, r in self._unwritten if n != name]
        except OSError as exc:
            self._disk_refused(exc, "the rejects file")
            return False
        self._disk_ok()
        return True

    def _record(self, path: Path) -> None:
        """Record durably how far ``path`` is settled: up to its first held request, else all that was
        sent. Not while rejects wait in memory (a restart must redo them)."""
        if path not in self._sent or not self._flush():
            return
        held = self.held.get(path)
        offset = min(h.lines[0].start for h in held) if held else self._sent[path]
        if time.monotonic() < self._disk_retry_at:
            return
        try:
            spool.write_ack(path, offset)
        except OSError as exc:
            self._disk_refused(exc, "the progress record")
            return
        self._disk_ok()
