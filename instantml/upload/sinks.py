"""Where a :class:`~instantml.run.Run`'s checked events go: the :class:`Sink` protocol, and the spool
sink of the ``spool`` and ``offline`` modes (the ``thread`` mode's sink is
:class:`instantml.upload.uploader.ThreadUploader`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Any, Protocol

from instantml.upload import spool, spool_writer


class Sink(Protocol):
    """Where a run's checked events go: this process's spool file, or the in-process uploader."""

    def log(
        self,
        values: dict[str, float],
        step: int,
        rank: int,
        world_size: int,
        local_rank: int | None,
        weight: float,
    ) -> None: ...

    def log_scalars(self, values: dict[str, float], step: int, rank: int) -> None: ...

    def update_run(self, body: dict[str, Any]) -> None: ...

    def flush(self, timeout: float) -> None:
        """Send what waits now, and wait at most ``timeout`` s for it (the process is about to end)."""
        ...

    def close(self, timeout: float) -> None: ...


class SpoolSink:
    """The ``spool`` and ``offline`` modes: a :class:`~instantml.upload.spool_writer.SpoolWriter`, plus in
    ``spool`` mode the background uploader (:mod:`instantml.upload.background`, started unless one serves this
    spool already) and a bounded wait for it at ``close``."""

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        project: str,
        run_id: str,
        api_url: str,
        api_key: str | None,
        fsync: bool = False,
    ) -> None:
        self.writer = spool_writer.SpoolWriter(spool_dir, project, run_id, fsync)
        self.log = self.writer.log
        self.log_scalars = self.writer.log_scalars
        self.update_run = self.writer.update_run
        self.api_url = api_url
        self.api_key = api_key
        self.uploader: subprocess.Popen[bytes] | None = None
        if api_url:
            with contextlib.suppress(OSError):
                spool.write_config(self.writer.dir, api_url)
        if api_key is not None:
            from instantml.upload.background import start_background

            self.uploader = start_background(self.writer.dir, api_url, api_key)

    def flush(self, timeout: float) -> None:
        """Nothing to wait for: every line is in the spool file once ``log`` returns, and the uploader, a
        process of its own session, outlives this one and sends it."""

    def close(self, timeout: float) -> None:
        import logging

        logger = logging.getLogger("instantml")
        writer = self.writer
        writer.close()
        spool_dir = writer.dir
        if writer.unwritten or writer.lost:
            logger.error(
                "instantml: %d event(s) could not be written to %s (%s); they are lost",
                writer.unwritten + writer.lost,
                spool_dir,
                writer.error,
            )
        if self.api_key is None:
            # WARNING, as every message of the client a user must see: with no logging configured, Python
            # prints WARNING and above to stderr (its last-resort handler); INFO would vanish.
            logger.warning(
                "instantml: offline mode: %d event(s) of this process are in the spool %s, nothing uploaded "
                "yet; upload them with: instantml sync %s%s",
                writer.written,
                spool_dir,
                spool_dir,
                "" if self.api_url else " --api-url URL",
            )
            return
        from instantml.upload.background import start_background, uploader_running

        deadline = time.monotonic() + timeout
        delay = 0.01
        restarted = False
        while True:
            pending = spool.pending_lines(writer.path) if writer.path.exists() else 0
            if pending == 0:
                break
            ours = self.uploader
            if (ours is None or ours.returncode is not None) and not uploader_running(spool_dir):
                # The uploader was killed, or gave up: start another one, once. One that dies again
                # is not restarted in a loop (a full disk, a broken setup): finish says so below.
                if restarted:
                    break
                self.uploader = start_background(spool_dir, self.api_url, self.api_key)
                restarted = True
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        self._report(pending, timeout)

    def _report(self, pending: int, timeout: float) -> None:
        """Say what is true of this process's events at ``finish``: set aside, still waiting (and why,
        from the uploader's status), or in the spool with no uploader alive."""
        import logging

        from instantml.upload import transport
        from instantml.upload.background import uploader_running

        logger = logging.getLogger("instantml")
        spool_dir = self.writer.dir
        name = self.writer.path.name
        set_aside, reasons = spool.count_set_aside(spool_dir, name)
        if set_aside:
            logger.warning(
                "instantml: %d request(s) of this process were set aside in %s: %s. They are kept, not "
                "sent; once the server is fixed: instantml sync %s --resend-set-aside",
                set_aside,
                spool_dir / spool.SET_ASIDE,
                reasons[-1],
                spool_dir,
            )
        if pending == 0:
            return
        log_file = spool_dir / spool.UPLOADER_LOG
        if not uploader_running(spool_dir):
            logger.warning(
                "instantml: %d event(s) of this process are not acknowledged by the server yet, and no "
                "background uploader is running (it exited: see %s). They are safe in %s; send them "
                "with: instantml sync %s",
                pending,
                log_file,
                spool_dir,
                spool_dir,
            )
            return
        status = spool.read_status(spool_dir)
        held = [h for h in status.get("held", []) if isinstance(h, dict) and h.get("file") == name]
        pid = status.get("pid", "?")
        if held:
            rule = transport.PoisonRule.from_env()
            logger.warning(
                "instantml: %d request(s) of this process are waiting for another attempt after %.0f s: "
                "%s: %s. The background uploader (pid %s) keeps sending the others meanwhile and keeps "
                "trying it; a request the server fails on %d times over %.0f s while it takes %d others "
                "is set aside in %s. %d line(s) of this process are not acknowledged yet (the events "
                "after a waiting request may be stored already); they are safe in %s (log: %s)",
                len(held),
                timeout,
                held[0].get("what"),
                held[0].get("why"),
                pid,
                rule.attempts,
                rule.seconds,
                rule.successes,
                spool_dir / spool.SET_ASIDE,
                pending,
                spool_dir,
                log_file,
            )
            return
        disk = status.get("disk_error")
        logger.warning(
            "instantml: %d event(s) of this process are not acknowledged by the server yet after %.0f s; "
            "they are safe in %s and the background uploader (pid %s) keeps sending them%s (log: %s). "
            "To send them yourself: instantml sync %s",
            pending,
            timeout,
            spool_dir,
            pid,
            f"; it cannot record its progress now ({disk})" if disk else "",
            log_file,
            spool_dir,
        )
