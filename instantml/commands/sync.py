"""``instantml sync``: replay a spool in the foreground, with progress, and say what is left.

It runs the same :class:`~instantml.upload.replay.Replayer` as the background uploader, so it is safe beside a
running one (the server stores each event once; progress records never move backwards).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from instantml import settings
from instantml.upload import spool
from instantml.upload.replay import Replayer, Stop


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
        done = replayer.done - replayer.updated  # events: the run updates are counted apart
        total = max(self.total, done)
        filled = self.width if total == 0 else int(self.width * done / total)
        rate = done / max(now - self.started, 1e-9)
        text = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {done:,}/{total:,} events  {rate:,.0f} ev/s  "
            f"stored {replayer.stored:,}  duplicate {replayer.duplicate:,}  rejected {replayer.rejected:,}"
        )
        if replayer.updated:
            text += f"  run updates {replayer.updated:,}"
        if self.tty:
            self.stream.write("\r" + text + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own above the bar (on a terminal the bar is drawn again below it)."""
        if self.tty:
            self.stream.write("\r\033[K" + text + "\n")
            self.last = 0.0
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def leave(self) -> None:
        """End the bar's line on a terminal, so that what follows starts on a line of its own."""
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()


#: ``instantml sync`` exit codes: every event stored; some rejected; some still in the spool; some set
#: aside (the server failed on them while it took others); Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_STORED, EXIT_REJECTS, EXIT_PENDING, EXIT_SET_ASIDE, EXIT_INTERRUPTED = 0, 1, 3, 4, 130


def sync(spool_dir: Path, api_url: str, api_key: str, timeout: float = 600.0, progress: bool = True) -> int:
    """Replay a spool in the foreground, on stderr: a progress bar (with ``progress``), a line per
    failed attempt (the URL, the error, when the next attempt is), and what is left at the end.

    Safe beside a running background uploader (the server stores each event once; progress records
    never move backwards). Ctrl-C prints one line, what is still in the spool and how to resume, and
    raises ``KeyboardInterrupt`` again: everything acknowledged is recorded, the rest stays on disk."""
    out = sys.stderr
    bar = ProgressBar(0, out) if progress else None
    replayer = Replayer(
        spool_dir,
        api_url,
        api_key,
        give_up_after=timeout,
        on_progress=bar.update if bar else None,
        on_retry=_Notes(bar, out, timeout).retrying,
    )
    spool.clean_temporary(spool_dir)
    stopped = _replay(spool_dir, replayer, bar)
    if bar:
        bar.update(replayer, final=True)
    live = [p for p in spool.spool_files(spool_dir) if spool.writer_alive(p)]
    pending = _pending(spool_dir)
    set_aside = _report_leftovers(spool_dir, replayer, len(live), out)
    return _verdict(spool_dir, replayer, stopped, pending, set_aside, out)


class _Notes:
    """The lines printed while sync runs: above the bar when there is one, else plain."""

    def __init__(self, bar: ProgressBar | None, out: Any, timeout: float) -> None:
        self.bar = bar
        self.out = out
        self.timeout = timeout

    def say(self, text: str) -> None:
        if self.bar:
            self.bar.note(text)
        else:
            print(text, file=self.out, flush=True)

    def retrying(self, replayer: Replayer, url: str, delay: float) -> None:
        """The Replayer's ``on_retry``: the failed attempt, and when the next one is."""
        left = replayer.gives_up_in
        if left is None:
            then = f"retrying in {delay:.1f} s"
        elif delay >= left:
            then = f"last attempt in {delay:.1f} s (--timeout {self.timeout:g} s)"
        else:
            then = f"retrying in {delay:.1f} s, giving up in {math.ceil(left)} s"
        self.say(
            f"instantml sync: attempt {replayer.failures} at {url} failed ({replayer.last_error}); {then}"
        )


def _replay(spool_dir: Path, replayer: Replayer, bar: ProgressBar | None) -> str:
    """Drain the spool; why the replayer stopped before the end ("" if it did not). Ctrl-C says what is
    still in the spool and is raised again."""
    try:
        files = spool.spool_files(spool_dir)
        if bar:
            bar.total = sum(spool.pending_counts(path)[0] for path in files)
            bar.update(replayer)
        replayer.drain_all()
    except Stop as exc:
        return str(exc)
    except KeyboardInterrupt:
        if bar:
            bar.leave()
        _interrupted(spool_dir, replayer)
        raise
    return ""


def _report_leftovers(spool_dir: Path, replayer: Replayer, live: int, out: Any) -> int:
    """Print what the replay left behind: torn lines, live writers, requests set aside, a disk refusing
    writes. The number of requests set aside."""
    if replayer.torn:
        print(f"{replayer.torn} torn last line(s) ignored (a writer died in the middle of a write)", file=out)
    if live:
        print(f"{live} spool file(s) are still being written by live processes", file=out)
    set_aside, reasons = spool.count_set_aside(spool_dir)
    if set_aside:
        print(
            f"{set_aside:,} request(s) set aside in {spool_dir / spool.SET_ASIDE}: {reasons[-1]}"
            + (f" (and {set_aside - 1} more)" if set_aside > 1 else "")
            + f". They are kept, not sent; once the server is fixed: instantml sync {spool_dir} "
            "--resend-set-aside",
            file=out,
        )
    if replayer.disk_error:
        print(f"the disk of {spool_dir} refuses writes ({replayer.disk_error})", file=out)
    return set_aside


def _pending(spool_dir: Path) -> tuple[int, int]:
    """Events and run updates still in the spool, not acknowledged."""
    counts = [spool.pending_counts(p) for p in spool.spool_files(spool_dir)]
    return sum(events for events, _ in counts), sum(updates for _, updates in counts)


def _verdict(
    spool_dir: Path, replayer: Replayer, stopped: str, pending: tuple[int, int], set_aside: int, out: Any
) -> int:
    """The last line and the exit code: the worst of events pending, rejected, set aside."""
    if stopped or any(pending):
        print(
            f"not everything was sent: {spool.counted(*pending)} still in {spool_dir}. {stopped}".rstrip()
            + f"; to try again: instantml sync {spool_dir}",
            file=out,
        )
        return EXIT_PENDING
    rejects = spool.count_rejects(spool_dir)
    if rejects:
        print(f"{rejects:,} event(s) were rejected by the server: see {spool_dir / spool.REJECTS}", file=out)
        return EXIT_REJECTS
    if set_aside:
        return EXIT_SET_ASIDE
    updates = f"; {replayer.updated:,} run update(s)" if replayer.updated else ""
    sent = replayer.stored + replayer.duplicate
    # "0 new, 0 already there" read as if nothing was stored: say that nothing was left to send.
    done = (
        f"sent {sent:,}: {replayer.stored:,} new to the server, {replayer.duplicate:,} it already had"
        if sent
        else "nothing was left in the spool to send (the uploader had sent it all)"
    )
    print(f"every event is stored: {done}{updates}", file=out)
    return EXIT_STORED


def _interrupted(spool_dir: Path, replayer: Replayer) -> None:
    """The one line Ctrl-C prints; a second Ctrl-C while it counts is ignored (main thread only)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        masked = True
    except ValueError:  # not the main thread: cannot change the handler, nor receive SIGINT here
        previous, masked = None, False
    try:
        print(
            f"instantml sync: interrupted; {spool.counted(*_pending(spool_dir))} are still in {spool_dir}, "
            "safe on disk "
            f"({replayer.stored:,} stored by this sync); resume with: instantml sync {spool_dir}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        if masked:
            signal.signal(signal.SIGINT, previous)


def command(
    spool_dir: str | None,
    api_url: str | None,
    api_key: str | None,
    timeout: float,
    quiet: bool,
    resend_set_aside: bool = False,
) -> int:
    """``instantml sync`` with its arguments as given (None: not given): fill them in from the
    environment and the spool's ``spool.json``, check them, and sync."""
    directory = Path(spool_dir or os.environ.get(settings.SPOOL_DIR_ENV) or settings.DEFAULT_SPOOL_DIR)
    if not directory.is_dir():
        print(f"instantml sync: {directory} is not a spool directory", file=sys.stderr)
        return 2
    url = api_url or os.environ.get(settings.API_URL_ENV) or spool.read_config(directory).get("api_url")
    key = api_key or os.environ.get(settings.API_KEY_ENV)
    if not url or not key:
        print(
            "instantml sync: pass --api-url/--api-key or set INSTANTML_API_URL/INSTANTML_API_KEY",
            file=sys.stderr,
        )
        return 2
    if resend_set_aside:
        moved = spool.resend_set_aside(directory)
        print(f"instantml sync: {moved:,} set-aside request(s) put back into the spool", file=sys.stderr)
    try:
        return sync(directory, str(url), key, timeout=timeout, progress=not quiet)
    except KeyboardInterrupt:  # sync has said what is safe where: no traceback
        return EXIT_INTERRUPTED
