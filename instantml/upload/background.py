"""The spool's background uploader: the process ``init`` starts in spool mode to replay the spool.

``python -m instantml.upload.background SPOOL_DIR`` holds ``uploader.lock`` so that at most one runs per
spool, tails the spool's files with a :class:`~instantml.upload.replay.Replayer` while writers live, and exits
once the spool is empty. The token reaches it through its environment (``INSTANTML_API_KEY``), never through
a file or its command line; its log is ``SPOOL_DIR/uploader.log``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from instantml import settings
from instantml.upload import spool, transport
from instantml.upload.replay import Replayer, Stop

log = logging.getLogger("instantml.upload.background")


def try_lock(path: Path) -> int | None:
    """Take ``uploader.lock`` without waiting; write our pid into it. None if another uploader has it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:  # the pid is for people and ``finish``; a full disk must not stop the uploader
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass
    return fd


def uploader_running(spool_dir: Path) -> bool:
    return spool.lock_held(spool_dir / spool.UPLOADER_LOCK)


class _Status:
    """What ``finish()`` reads to say what is true (``spool.write_status``): written on a change, at
    most once a second (the reasons count seconds) unless what is held changed."""

    def __init__(self, spool_dir: Path) -> None:
        self.spool_dir = spool_dir
        self.reported: object = None
        self.reported_shape: object = None
        self.written = 0.0

    def update(self, replayer: Replayer) -> None:
        holding = replayer.held_report()
        status = {
            "pid": os.getpid(),
            "held": holding,
            "set_aside": replayer.set_aside,
            "disk_error": replayer.disk_error,
        }
        shape = (len(holding), replayer.set_aside, replayer.disk_error)
        if status != self.reported and (
            shape != self.reported_shape or time.monotonic() - self.written >= 1.0
        ):
            spool.write_status(self.spool_dir, status)
            self.reported, self.reported_shape, self.written = status, shape, time.monotonic()


def _drain_spool(replayer: Replayer, spool_dir: Path) -> bool:
    """One pass over the spool's files; whether anything was sent."""
    sent = False
    for path in spool.spool_files(spool_dir):
        sent = replayer.drain(path) or sent
    return sent


def _relock(spool_dir: Path, lock_path: Path) -> int | None:
    """Called with the lock dropped once the spool looked empty: a writer that appeared meanwhile either
    is seen here (its files, and the lock is ours again), or its init found no lock holder and started
    its own uploader. None when this uploader is done."""
    if not spool.spool_files(spool_dir):
        return None
    return try_lock(lock_path)


def _log_done(replayer: Replayer) -> None:
    log.info(
        "uploader %d done: %d stored, %d duplicate, %d rejected, %d set aside, %d torn line(s) ignored",
        os.getpid(),
        replayer.stored,
        replayer.duplicate,
        replayer.rejected,
        replayer.set_aside,
        replayer.torn,
    )


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
    if spool.clean_temporary(spool_dir):
        log.info("deleted temporary files that a process which died mid-write left in %s", spool_dir)
    # A live writer's lines wait for more (limits.UPLOAD_LINGER_S): one request per file per linger.
    replayer = Replayer(
        spool_dir, api_url, api_key, give_up_after=give_up_after, linger_s=transport.linger_s(api_url)
    )
    fd = held
    status = _Status(spool_dir)
    try:
        while True:
            sent = _drain_spool(replayer, spool_dir)
            status.update(replayer)
            if not spool.spool_files(spool_dir):
                os.close(fd)  # drop the lock, then look once more (_relock)
                fd = -1
                held = _relock(spool_dir, lock_path)
                if held is None:
                    break
                fd = held
            elif not sent:
                time.sleep(poll)
    except Stop as exc:
        log.error(
            "uploader stopped: %s. The events stay in the spool: run `instantml sync %s`", exc, spool_dir
        )
        return 3
    finally:
        if fd >= 0:
            os.close(fd)
    _log_done(replayer)
    return 0


def start_background(spool_dir: Path, api_url: str, api_key: str) -> subprocess.Popen[bytes] | None:
    """Start the uploader process for ``spool_dir`` unless one runs (None then).

    The token reaches it through its environment, never through a file or its command line.
    """
    import threading

    if uploader_running(spool_dir):
        return None
    env = {**os.environ, settings.API_URL_ENV: api_url, settings.API_KEY_ENV: api_key}
    with open(spool_dir / spool.UPLOADER_LOG, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "instantml.upload.background", str(spool_dir)],
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
        prog="python -m instantml.upload.background", description="The spool's background uploader."
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
    api_url = os.environ.get(settings.API_URL_ENV) or spool.read_config(spool_dir).get("api_url", "")
    api_key = os.environ.get(settings.API_KEY_ENV, "")
    if not api_url or not api_key:
        log.error("%s and %s are needed", settings.API_URL_ENV, settings.API_KEY_ENV)
        return 2
    return run_background(spool_dir, api_url, api_key, give_up_after=args.give_up_after)


if __name__ == "__main__":
    sys.exit(main())
