"""Replaying a spool through the batch routes: the background uploader and ``instantml sync``.

Both run the same :class:`Replayer`. Per spool file it reads whole lines after the acknowledged offset,
sends them in file order: rank events and ``run.log`` scalars in batches of their own route (each event
with its ``event_id``), run updates (config, finished: ``PATCH``) one by one with their ``event_id`` as
``Idempotency-Key``. It appends the server's per-event rejects to ``rejects.jsonl``, and only then
records the new offset. A crash anywhere resends at most one batch,
which the server answers with ``duplicate``: exactly once in effect. A finished file (its writer's lock
is gone) that is fully acknowledged is deleted; a torn last line is reported and ignored.

The background uploader (``python -m instantml.replay SPOOL_DIR``, started by ``init`` in spool mode)
holds ``uploader.lock`` so that at most one runs per spool, tails the files while writers live, and exits
once the spool is empty.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from instantml import limits, routes, spool, transport

log = logging.getLogger("instantml.replay")

#: Bytes of spool lines per batch: their batch body is smaller, so it stays under the 5 MiB limit.
BATCH_BYTES = 4 * 1024 * 1024


def _path_re(route: str) -> re.Pattern[str]:
    names = re.escape(route).replace(r"\{project\}", "([^/]+)").replace(r"\{run_id\}", "([^/]+)")
    return re.compile("^" + names + "$")


#: What a spool line may request, as (method, its path, where it is sent): rank events and scalars
#: through their batch routes, run updates (config, finished) one by one to the run's own route.
KINDS = (
    ("POST", _path_re(routes.RANK_METRICS), routes.RANK_METRICS_BATCH),
    ("POST", _path_re(routes.SCALARS), routes.SCALARS_BATCH),
    ("PATCH", _path_re(routes.RUN), routes.RUN),
)


def _destination(method: object, path: str) -> str | None:
    """Where a spool line's request is sent (a path), or None when this client sends no such request."""
    for kind_method, pattern, route in KINDS:
        found = pattern.match(path) if method == kind_method else None
        if found:
            return route.format(project=found.group(1), run_id=found.group(2))
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
    ) -> None:
        self.dir = spool_dir
        self.api_url = api_url.rstrip("/")
        self.api_key = api_key
        self.batch_events = max(1, min(batch_events, limits.MAX_BATCH_EVENTS))
        self.give_up_after = give_up_after
        self.on_progress = on_progress
        self.stored = self.duplicate = self.rejected = self.torn = 0
        #: Run updates (config, finished) the server took.
        self.updated = 0
        self.failures = 0
        self.last_error = ""

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
            j = i
            while (
                j < len(lines)
                and j - i < self.batch_events
                and lines[j].event is not None
                and lines[j].method == "POST"
                and lines[j].url_path == lines[i].url_path
            ):
                j += 1
            self._send_batch(path, lines[i:j])
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
                self._retry_later(exc, started, f"batch of {len(batch)}")
                continue
            except transport.Refused as exc:
                if exc.about_setup:
                    raise Stop(f"the server refuses this spool's requests: {exc}") from None
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
        body = json.dumps({k: v for k, v in line.event.items() if k != "event_id"}, allow_nan=False).encode()
        url = self.api_url + line.url_path
        started = time.monotonic()
        while True:
            try:
                transport.patch_run(url, self.api_key, body, event_id)
            except transport.Transient as exc:
                self._retry_later(exc, started, "run update")
                continue
            except transport.Refused as exc:
                if exc.status in transport.AUTH_STATUSES:
                    raise Stop(f"the server refuses this spool's requests: {exc}") from None
                self._reject(path, [(line, exc.error)])
                return
            self.failures = 0
            self.updated += 1
            return

    def _retry_later(self, exc: transport.Transient, started: float, what: str) -> None:
        """Count a transient failure and wait before the next attempt (or give up: :class:`Stop`)."""
        self.failures += 1
        self.last_error = str(exc)
        if self.give_up_after is not None and time.monotonic() - started > self.give_up_after:
            raise Stop(f"the server has not taken events for {self.give_up_after:.0f} s: {exc}") from None
        delay = transport.backoff(self.failures, exc.retry_after)
        log.info("%s not sent (%s); retrying in %.1f s", what, exc, delay)
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


# --- instantml sync ---------------------------------------------------------------------------------


class ProgressBar:
    """One stderr line redrawn in place: events done of total, rate, rejects (stdlib only)."""

    def __init__(self, total: int, stream: Any = None, width: int = 24) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.monotonic()
        self.last = 0.0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, replayer: Replayer, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < (0.1 if self.tty else 5.0):
            return
        self.last = now
        done = replayer.done
        total = max(self.total, done)
        filled = self.width if total == 0 else int(self.width * done / total)
        rate = done / max(now - self.started, 1e-9)
        text = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {done:,}/{total:,} events  {rate:,.0f} ev/s  "
            f"stored {replayer.stored:,}  duplicate {replayer.duplicate:,}  rejected {replayer.rejected:,}"
        )
        if replayer.updated:
            text += f"  run updates {replayer.updated:,}"
        if replayer.failures:
            text += f"  retrying: {replayer.last_error[:60]}"
        if self.tty:
            self.stream.write("\r" + text + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


#: ``instantml sync`` exit codes.
EXIT_STORED, EXIT_REJECTS, EXIT_PENDING = 0, 1, 3


def sync(spool_dir: Path, api_url: str, api_key: str, timeout: float = 600.0, progress: bool = True) -> int:
    """Replay a spool in the foreground. Safe beside a running background uploader (the server stores
    each event once; progress records never move backwards)."""
    files = spool.spool_files(spool_dir)
    total = sum(spool.pending_lines(path) for path in files)
    bar = ProgressBar(total) if progress else None
    replayer = Replayer(
        spool_dir,
        api_url,
        api_key,
        give_up_after=timeout,
        on_progress=bar.update if bar else None,
    )
    stopped = ""
    try:
        for path in files:
            replayer.drain(path)
    except Stop as exc:
        stopped = str(exc)
    if bar:
        bar.update(replayer, final=True)
    out = sys.stderr
    live = [p for p in spool.spool_files(spool_dir) if spool.writer_alive(p)]
    pending = sum(spool.pending_lines(p) for p in spool.spool_files(spool_dir))
    if replayer.torn:
        print(f"{replayer.torn} torn last line(s) ignored (a writer died in the middle of a write)", file=out)
    if live:
        print(f"{len(live)} spool file(s) are still being written by live processes", file=out)
    if stopped or pending:
        print(
            f"not everything was sent: {pending:,} event(s) still in {spool_dir}. {stopped}".rstrip(),
            file=out,
        )
        return EXIT_PENDING
    rejects = spool.count_rejects(spool_dir)
    if rejects:
        print(f"{rejects:,} event(s) were rejected by the server: see {spool_dir / spool.REJECTS}", file=out)
        return EXIT_REJECTS
    updates = f", {replayer.updated:,} run update(s)" if replayer.updated else ""
    print(
        f"every event is stored ({replayer.stored:,} new, {replayer.duplicate:,} already there{updates})",
        file=out,
    )
    return EXIT_STORED


# --- the background uploader -----------------------------------------------------------------------


def try_lock(path: Path) -> int | None:
    """Take ``uploader.lock`` without waiting; write our pid into it. None if another uploader has it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def uploader_running(spool_dir: Path) -> bool:
    return spool.lock_held(spool_dir / spool.UPLOADER_LOCK)


def run_background(
    spool_dir: Path, api_url: str, api_key: str, poll: float = 0.2, give_up_after: float = 3600.0
) -> int:
    """Tail the spool until it is empty and no writer is left; at most one per spool (the lock)."""
    lock_path = spool_dir / spool.UPLOADER_LOCK
    held = try_lock(lock_path)
    if held is None:
        log.info("another uploader holds %s; leaving the spool to it", lock_path)
        return 0
    log.info("uploader %d started on %s for %s", os.getpid(), spool_dir, api_url)
    replayer = Replayer(spool_dir, api_url, api_key, give_up_after=give_up_after)
    fd = held
    try:
        while True:
            sent = False
            for path in spool.spool_files(spool_dir):
                sent = replayer.drain(path) or sent
            if not spool.spool_files(spool_dir):
                # Drop the lock, then look once more: a writer that appeared meanwhile either is seen
                # here, or its init found no lock holder and started its own uploader.
                os.close(fd)
                fd = -1
                if not spool.spool_files(spool_dir):
                    break
                held = try_lock(lock_path)
                if held is None:
                    break
                fd = held
                continue
            if not sent:
                time.sleep(poll)
    except Stop as exc:
        log.error(
            "uploader stopped: %s. The events stay in the spool: run `instantml sync %s`", exc, spool_dir
        )
        return 3
    finally:
        if fd >= 0:
            os.close(fd)
    log.info(
        "uploader %d done: %d stored, %d duplicate, %d rejected, %d torn line(s) ignored",
        os.getpid(),
        replayer.stored,
        replayer.duplicate,
        replayer.rejected,
        replayer.torn,
    )
    return 0


def start_background(spool_dir: Path, api_url: str, api_key: str) -> subprocess.Popen[bytes] | None:
    """Start the uploader process for ``spool_dir`` unless one runs (None then).

    The token reaches it through its environment, never through a file or its command line.
    """
    import threading

    if uploader_running(spool_dir):
        return None
    env = dict(os.environ, INSTANTML_API_URL=api_url, INSTANTML_API_KEY=api_key)
    with open(spool_dir / spool.UPLOADER_LOG, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "instantml.replay", str(spool_dir)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,  # outlives the training process and its launcher's signals
            close_fds=True,
        )
    # Reap it when it exits (no zombie while training goes on).
    threading.Thread(target=proc.wait, name="instantml-uploader-reaper", daemon=True).start()
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m instantml.replay", description="The spool's background uploader."
    )
    parser.add_argument("spool_dir")
    parser.add_argument(
        "--give-up-after", type=float, default=3600.0, help="seconds of failures before exiting"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s uploader[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    spool_dir = Path(args.spool_dir)
    api_url = os.environ.get("INSTANTML_API_URL") or spool.read_config(spool_dir).get("api_url", "")
    api_key = os.environ.get("INSTANTML_API_KEY", "")
    if not api_url or not api_key:
        log.error("INSTANTML_API_URL and INSTANTML_API_KEY are needed")
        return 2
    return run_background(spool_dir, api_url, api_key, give_up_after=args.give_up_after)


if __name__ == "__main__":
    sys.exit(main())
