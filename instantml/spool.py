"""The spool (contract section 4): its files, the writer in the training process, and reading it back.

A spool directory holds:

- ``{project}@{run_id}@{host}@pid{pid}@rank{rank}@{tag}.jsonl``: one append-only file per writing
  process, one JSON request event per line. The writer holds an exclusive ``flock`` on its file for as
  long as it may append, so a reader knows a file is complete when it can take that lock (the kernel
  drops it when the writer exits or is killed).
- ``{file}.ack``: how far into that file the server has acknowledged (a byte offset after a whole line),
  replaced atomically, so a restarted uploader resumes there.
- ``rejects.jsonl``: events the server refused (4xx), each with the server's error.
- ``set-aside.jsonl``: requests the server kept failing on (5xx) while it took others, each with the
  reason (``instantml.transport.Attempts.poison``); ``instantml sync --resend-set-aside`` sends them again.
- ``spool.json``: the API URL the spool was made for (never the token); ``uploader.lock`` and
  ``uploader.log``: the background uploader's lock (it holds its pid) and its log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from instantml import routes

SUFFIX = ".jsonl"
ACK_SUFFIX = ".ack"
REJECTS = "rejects.jsonl"
SET_ASIDE = "set-aside.jsonl"
#: The background uploader's word on what it holds back (for ``finish``), replaced as it changes.
UPLOADER_STATUS = "uploader.status.json"
CONFIG = "spool.json"
UPLOADER_LOCK = "uploader.lock"
UPLOADER_LOG = "uploader.log"
PROGRESS_LOCK = "progress.lock"
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


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text) or "-"


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
        host = _safe(socket.gethostname())
        name = f"{project}@{run_id}@{host}@pid{os.getpid()}@rank{_rank_label()}@{os.urandom(3).hex()}"
        self.path = self.dir / (name + SUFFIX)
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


# --- reading a spool back -------------------------------------------------------------------------


def spool_files(spool_dir: Path) -> list[Path]:
    return sorted(p for p in spool_dir.glob("*" + SUFFIX) if p.name not in (REJECTS, SET_ASIDE))


def writer_alive(path: Path) -> bool:
    """True while a writer holds the file's lock (a live process that may still append)."""
    return lock_held(path)


def lock_held(path: Path) -> bool:
    """True while some process holds an exclusive ``flock`` on ``path``."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def ack_path(path: Path) -> Path:
    return path.with_name(path.name + ACK_SUFFIX)


def read_ack(path: Path) -> int:
    try:
        return int(json.loads(ack_path(path).read_text())["offset"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


class _Locked:
    """An exclusive ``flock`` on a file, as a context manager."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _Locked:
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def write_ack(path: Path, offset: int) -> int:
    """Record durably that the server acknowledged ``path`` up to ``offset``; never moves backwards
    (another uploader may be ahead). Returns the recorded offset. A disk that refuses it (full, quota)
    raises ``OSError`` and leaves no temporary file behind."""
    with _Locked(path.parent / PROGRESS_LOCK):
        current = read_ack(path)
        if offset <= current:
            return current
        target = ack_path(path)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps({"offset": offset, "time": time.time()}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)
        return offset


def clean_temporary(spool_dir: Path) -> int:
    """Delete what a process that died mid-write left: ``*.ack.<pid>.tmp`` (always stale once the
    progress lock is ours: they are written under it) and ``spool.json.<pid>.tmp`` of dead processes.
    Returns how many were deleted."""
    removed = 0
    try:
        with _Locked(spool_dir / PROGRESS_LOCK):
            for tmp in spool_dir.glob("*" + ACK_SUFFIX + ".*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    removed += 1
    except OSError:
        return removed
    for tmp in spool_dir.glob(CONFIG + ".*.tmp"):
        pid = tmp.name[len(CONFIG) + 1 : -len(".tmp")]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def append_rejects(spool_dir: Path, rows: list[dict[str, Any]]) -> None:
    append_rows(spool_dir, REJECTS, rows)


def append_rows(spool_dir: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """Append JSON rows to ``spool_dir/name`` (the rejects or set-aside file), synced. A disk that
    refuses them raises ``OSError`` and the file is cut back to its size before (no torn row)."""
    if not rows:
        return
    data = "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows).encode()
    with _Locked(spool_dir / PROGRESS_LOCK):
        fd = os.open(spool_dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(28, f"short write ({written} of {len(data)} bytes)")
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def count_set_aside(spool_dir: Path, file: str | None = None) -> tuple[int, list[str]]:
    """Requests in the set-aside file (those of spool file ``file`` only, if given): how many, and
    their reasons."""
    ids: set[str] = set()
    reasons: list[str] = []
    try:
        with open(spool_dir / SET_ASIDE, "rb") as f:
            for n, raw in enumerate(f):
                try:
                    row = json.loads(raw)
                    if file is not None and row.get("file") != file:
                        continue
                    key = str(row["event"]["event_id"])
                except (ValueError, KeyError, TypeError):
                    key, row = f"line {n}", {}
                if key not in ids:
                    ids.add(key)
                    reasons.append(str(row.get("reason", "")))
    except FileNotFoundError:
        pass
    return len(ids), reasons


def resend_set_aside(spool_dir: Path) -> int:
    """Move the set-aside requests back into the spool (a new, finished spool file), for the next
    replay to send again. Returns how many."""
    with _Locked(spool_dir / PROGRESS_LOCK):
        try:
            raw = (spool_dir / SET_ASIDE).read_bytes()
        except FileNotFoundError:
            return 0
        lines, seen = [], set()
        for row_raw in raw.splitlines():
            try:
                event = json.loads(row_raw)["event"]
                key = str(event["event_id"])
            except (ValueError, KeyError, TypeError):
                continue
            if key not in seen:
                seen.add(key)
                lines.append(json.dumps(event, allow_nan=False) + "\n")
        if lines:
            name = f"resend@{_safe(socket.gethostname())}@pid{os.getpid()}@{os.urandom(3).hex()}"
            creating = spool_dir / (name + ".creating")
            with open(creating, "w") as f:
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
            os.rename(creating, spool_dir / (name + SUFFIX))
        (spool_dir / SET_ASIDE).unlink()
        _fsync_dir(spool_dir)
        return len(lines)


def count_rejects(spool_dir: Path) -> int:
    """Distinct events in the rejects file (two uploaders may both have recorded one)."""
    ids: set[str] = set()
    try:
        with open(spool_dir / REJECTS, "rb") as f:
            for n, row in enumerate(f):
                try:
                    ids.add(str(json.loads(row)["event"]["event_id"]))
                except (ValueError, KeyError, TypeError):
                    ids.add(f"line {n}")
    except FileNotFoundError:
        pass
    return len(ids)


def remove(path: Path) -> None:
    """Delete a fully acknowledged, finished spool file and its progress record."""
    for p in (path, ack_path(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Chunk:
    """Whole lines of one spool file from ``start`` to ``end`` (byte offsets)."""

    start: int
    end: int
    lines: list[bytes]


def read_lines(path: Path, offset: int, max_bytes: int) -> tuple[Chunk, int]:
    """The whole lines after ``offset`` (at most about ``max_bytes``), and the size of a trailing
    partial line (a line still being written, or torn if its writer is gone)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(max_bytes)
            more = f.read(1) != b""
    except FileNotFoundError:
        return Chunk(offset, offset, []), 0
    cut = data.rfind(b"\n") + 1
    if cut == 0 and more and len(data) == max_bytes:  # one line longer than max_bytes: read it all
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        more = False
    lines = data[:cut].splitlines(keepends=True)
    tail = 0 if more else len(data) - cut
    return Chunk(offset, offset + cut, lines), tail


def pending_lines(path: Path) -> int:
    """Whole lines of ``path`` not yet acknowledged."""
    offset = read_ack(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def read_config(spool_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((spool_dir / CONFIG).read_text())
        return config if isinstance(config, dict) else {}
    except (OSError, ValueError):
        return {}


def write_config(spool_dir: Path, api_url: str) -> None:
    tmp = spool_dir / f"{CONFIG}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"api_url": api_url}))
        os.replace(tmp, spool_dir / CONFIG)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_status(spool_dir: Path, status: dict[str, Any]) -> None:
    """The uploader's status (best effort: a full disk only makes it stale)."""
    tmp = spool_dir / f"{UPLOADER_STATUS}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(status))
        os.replace(tmp, spool_dir / UPLOADER_STATUS)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_status(spool_dir: Path) -> dict[str, Any]:
    try:
        status = json.loads((spool_dir / UPLOADER_STATUS).read_text())
        return status if isinstance(status, dict) else {}
    except (OSError, ValueError):
        return {}
