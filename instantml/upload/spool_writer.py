"""The spool's writer in the training process (contract section 4): one append-only file of request
events per process, in the format of :mod:`instantml.upload.spool`, which reads a spool back."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from instantml import routes
from instantml.upload import spool

#: Free space below which ``init`` refuses a spool directory rather than fail mid-training.
MIN_FREE_BYTES = 64 * 1024 * 1024
#: Lines the writer keeps in memory while the disk refuses them (disk full); beyond it, events are lost
#: and counted.
MAX_BACKLOG = 100_000
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


class SpoolError(OSError):
    """The spool directory cannot take events (not writable, not a directory, disk full).

    Its message starts with ``spool_dir:``; ``errno`` is the underlying error's, when there is one."""

    def __init__(self, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = errno


def _rank_label(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return value
    return "NA"


def event_path(project: str, run_id: str, route: str = routes.RANK_METRICS) -> str:
    """``route`` (a path of :mod:`instantml.routes`) for this run, its names quoted for a URL."""
    return route.format(project=quote(project, safe=""), run_id=quote(run_id, safe=""))


class SpoolWriter:
    """Appends one JSON request event per ``log`` call to this process's own spool file.

    One ``os.write`` of one whole line per event with ``O_APPEND``, no fsync unless ``fsync=True``.
    A failed or short write is cut back off the file (so no torn line sits between whole ones) and the
    line waits in memory until the disk takes it again; ``log`` never raises because of the disk.
    """

    def __init__(self, spool_dir: str | os.PathLike[str], project: str, run_id: str, fsync: bool = False):
        import fcntl

        self.dir = Path(spool_dir)
        self.fsync = fsync
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            free = os.statvfs(self.dir)
        except OSError as exc:
            raise SpoolError(
                exc.errno, f"spool_dir: cannot use {str(self.dir)!r} as a spool directory: {exc}"
            ) from None
        if free.f_bavail * free.f_frsize < MIN_FREE_BYTES:
            raise SpoolError(
                28,
                f"spool_dir: {str(self.dir)!r} has only {free.f_bavail * free.f_frsize // 1024} KiB free "
                f"(at least {MIN_FREE_BYTES // 2**20} MiB needed); free some space or choose another "
                "spool_dir",
            )
        host = spool.host_name()
        name = f"{project}@{run_id}@{host}@pid{os.getpid()}@rank{_rank_label()}@{os.urandom(3).hex()}"
        self.path = self.dir / (name + spool.SUFFIX)
        creating = self.dir / (name + ".creating")
        try:
            # Locked before it gets its final name: a reader never sees this file without its writer.
            self._fd = os.open(creating, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(creating, self.path)
        except OSError as exc:
            raise SpoolError(
                exc.errno, f"spool_dir: cannot create a spool file in {str(self.dir)!r}: {exc}"
            ) from None
        self._size = 0
        self._backlog: list[bytes] = []
        self.written = 0
        self.lost = 0
        self.error: str | None = None
        self._middle = (
            '","method":"POST","path":' + json.dumps(event_path(project, run_id)) + ',"body":{"step":'
        )
        self._scalars_middle = (
            '","method":"POST","path":'
            + json.dumps(event_path(project, run_id, routes.SCALARS))
            + ',"body":{"step":'
        )
        self._run_middle = '","method":"PATCH","path":' + json.dumps(event_path(project, run_id, routes.RUN))
        self._keys: dict[str, str] = {}
        self._weight, self._weight_json = 1.0, "1.0"
        self._dumps: Callable[[Any], bytes] | None
        try:  # an optional speed-up only: the client needs nothing but the standard library
            import orjson

            self._dumps = orjson.dumps
        except ImportError:
            self._dumps = None
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        """Event ids are a random per-writer prefix and a counter: a forked child needs its own prefix."""
        self._head = '{"v":1,"event_id":"' + os.urandom(10).hex()
        self._count = itertools.count()

    def log(
        self,
        values: dict[str, float],
        step: int,
        rank: int,
        world_size: int,
        local_rank: int | None,
        weight: float,
    ) -> None:
        """The hot path: encode one event as one JSON line (by hand, or with orjson if installed) and
        append it with one ``os.write``."""
        # repr() of a float costs about 0.5 us: the time is formatted from integer nanoseconds, and the
        # weight (usually the same every call) is formatted once per value.
        t = "%d.%09d" % divmod(time.time_ns(), 1_000_000_000)  # noqa: UP031
        if weight != self._weight:
            self._weight, self._weight_json = weight, repr(weight)
        metrics = self._metrics_json(values)
        # %-formatting of one template measured faster here than f-strings or joins.
        line = (
            '%s%012x%s%d,"rank":%d,"world_size":%d,%s"weight":%s,"metrics":%s,"time":%s},"created":%s}\n'  # noqa: UP031
            % (
                self._head,
                next(self._count),
                self._middle,
                step,
                rank,
                world_size,
                "" if local_rank is None else f'"local_rank":{local_rank},',
                self._weight_json,
                metrics,
                t,
                t,
            )
        ).encode()
        self._write(line)

    def _metrics_json(self, values: dict[str, float]) -> str:
        """The metrics object of an event: by hand, or with orjson if installed."""
        if self._dumps is not None:  # orjson, when installed: its C float formatting is exact and fast
            for value in values.values():
                if value - value != 0.0:  # NaN or +/-Infinity: orjson would write null
                    break
            else:
                return self._dumps(values).decode()
        keys = self._keys
        parts = []
        for key, value in values.items():
            encoded = keys.get(key)
            if encoded is None:
                encoded = keys[key] = json.dumps(key) + ":"
            if value - value == 0.0:  # finite: repr() of a finite float is valid JSON
                parts.append(encoded + repr(value))
            else:
                parts.append(
                    encoded + ('"NaN"' if value != value else '"Infinity"' if value > 0 else '"-Infinity"')
                )
        return "{" + ",".join(parts) + "}"

    def log_scalars(self, values: dict[str, float], step: int, rank: int) -> None:
        """``run.log``'s hot path: one scalars request event (the SCALARS route), encoded as ``log`` does."""
        t = "%d.%09d" % divmod(time.time_ns(), 1_000_000_000)  # noqa: UP031
        line = (
            '%s%012x%s%d,"rank":%d,"metrics":%s,"time":%s},"created":%s}\n'  # noqa: UP031
            % (
                self._head,
                next(self._count),
                self._scalars_middle,
                step,
                rank,
                self._metrics_json(values),
                t,
                t,
            )
        ).encode()
        self._write(line)

    def update_run(self, body: dict[str, Any]) -> None:
        """One run update request event (``PATCH`` of the RUN route) with ``body`` (JSON-ready)."""
        t = "%d.%09d" % divmod(time.time_ns(), 1_000_000_000)  # noqa: UP031
        line = '%s%012x%s,"body":%s,"created":%s}\n' % (  # noqa: UP031
            self._head,
            next(self._count),
            self._run_middle,
            json.dumps(body, allow_nan=False, separators=(",", ":")),
            t,
        )
        self._write(line.encode())

    def _write(self, line: bytes) -> None:
        """Append one whole line with one ``os.write``; a failed or short write keeps it in memory."""
        if self._backlog:
            self._backlog.append(line)
            self._flush_backlog()
            return
        try:
            n = os.write(self._fd, line)
        except OSError as exc:
            self._failed(line, exc)
            return
        if n != len(line):
            self._failed(line, OSError(f"short write ({n} of {len(line)} bytes)"))
            return
        self._size += n
        self.written += 1
        if self.fsync:
            os.fsync(self._fd)

    def _failed(self, line: bytes, exc: OSError) -> None:
        import logging

        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)  # cut a partial line back off
        if self.error is None:
            logging.getLogger("instantml").error(
                "instantml: cannot write to the spool file %s (%s); keeping events in memory and retrying",
                self.path,
                exc,
            )
        self.error = str(exc)
        if len(self._backlog) < MAX_BACKLOG:
            self._backlog.append(line)
        else:
            self.lost += 1

    def _flush_backlog(self) -> bool:
        while self._backlog:
            line = self._backlog[0]
            try:
                n = os.write(self._fd, line)
            except OSError:
                n = -1
            if n != len(line):
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._size)
                if len(self._backlog) > MAX_BACKLOG:
                    self.lost += 1
                    self._backlog.pop()
                return False
            self._size += n
            self.written += 1
            self._backlog.pop(0)
        self.error = None
        return True

    @property
    def unwritten(self) -> int:
        return len(self._backlog)

    def close(self) -> None:
        """Write what waits in memory if the disk takes it now, fsync, and drop the writer's lock."""
        if self._fd < 0:
            return
        self._flush_backlog()
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
