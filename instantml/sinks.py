"""Where a :class:`~instantml.run.Run`'s checked events go: the :class:`Sink` protocol, and the spool
sink of the ``spool`` and ``offline`` modes (the ``thread`` mode's sink is
:class:`instantml.uploader.ThreadUploader`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Any, Protocol

from instantml import spool


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

    def close(self, timeout: float) -> None: ...


class SpoolSink:
    """The ``spool`` and ``offline`` modes: a :class:`~instantml.spool.SpoolWriter`, plus in ``spool``
    mode the background uploader (:mod:`instantml.background`, started unless one serves this spool
    already) and a bounded wait for it at ``close``."""

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        project: str,
        run_id: str,
        api_url: str,
        api_key: str | None,
        fsync: bool = False,
    ) -> None:
        self.writer = spool.SpoolWriter(spool_dir, project, run_id, fsync)
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
            from instantml.background import start_background

            self.uploader = start_background(self.writer.dir, api_url, api_key)

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
        from instantml.background import start_background, uploader_running

        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            pending = spool.pending_lines(writer.path) if writer.path.exists() else 0
            if pending == 0:
                return
            ours = self.uploader
            if (ours is None or ours.returncode is not None) and not uploader_running(spool_dir):
                # the uploader was killed, or gave up: start another one
                self.uploader = start_background(spool_dir, self.api_url, self.api_key)
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        logger.warning(
            "instantml: %d event(s) of this process are not acknowledged by the server yet after %.0f s; "
            "they are safe in %s and the background uploader keeps sending them (log: %s). "
            "To send them yourself: instantml sync %s",
            pending,
            timeout,
            spool_dir,
            spool_dir / spool.UPLOADER_LOG,
            spool_dir,
        )
