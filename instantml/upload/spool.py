"""The spool (contract section 4): its files, and reading a spool back (the writer in the training process
is :mod:`instantml.upload.spool_writer`).

A spool directory holds:

- ``{project}@{run_id}@{host}@pid{pid}@rank{rank}@{tag}.jsonl``: one append-only file per writing
  process, one JSON request event per line. The writer holds an exclusive ``flock`` on its file for as
  long as it may append, so a reader knows a file is complete when it can take that lock (the kernel
  drops it when the writer exits or is killed).
- ``{file}.ack``: how far into that file the server has acknowledged (a byte offset after a whole line),
  replaced atomically, so a restarted uploader resumes there.
- ``rejects.jsonl``: events the server refused (4xx), each with the server's error.
- ``set-aside.jsonl``: requests the server kept failing on (5xx) while it took others, each with the
  reason (``instantml.upload.transport.Attempts.poison``); ``instantml sync --resend-set-aside`` sends them
  again.
- ``spool.json``: the API URL the spool was made for (never the token); ``uploader.lock`` and
  ``uploader.log``: the background uploader's lock (it holds its pid) and its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def host_name() -> str:
    """This machine's name as a spool file name may carry it."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "-"


def spool_files(spool_dir: Path) -> list[Path]:
    return sorted(p for p in spool_dir.glob("*" + SUFFIX) if p.name not in (REJECTS, SET_ASIDE))


_WRITER_FILE = re.compile(r"@pid(\d+)@rank[^@]*@[0-9a-f]+$")


def writer_pid(path: Path) -> int | None:
    """The pid of the training process whose own spool file ``path`` is (its name says it), else None
    (a resend of set-aside requests, an uploader's report, a file of another tool).

    >>> writer_pid(Path("p@r@host@pid4242@rank3@a1b2c3.jsonl"))
    4242
    >>> writer_pid(Path("p@r@host@pid4242@rank3@a1b2c3-gone.jsonl")) is None
    True
    """
    found = _WRITER_FILE.search(path.name.removesuffix(SUFFIX))
    return int(found.group(1)) if found else None


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
            write_finished(spool_dir, f"resend@{host_name()}@pid{os.getpid()}@{os.urandom(3).hex()}", lines)
        (spool_dir / SET_ASIDE).unlink()
        _fsync_dir(spool_dir)
        return len(lines)


def write_finished(spool_dir: Path, name: str, lines: list[str]) -> Path:
    """A finished spool file (no writer holds it) ``name`` + ``SUFFIX`` with ``lines``, synced and
    renamed into place whole, so a reader sees all of it or nothing."""
    creating = spool_dir / (name + ".creating")
    with open(creating, "w") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
    path = spool_dir / (name + SUFFIX)
    os.rename(creating, path)
    _fsync_dir(spool_dir)
    return path


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


#: What marks a run update's line (``SpoolWriter.update_run``): no event's line can hold it, as a metric's
#: value is a number or one of the strings NaN and Infinity.
_RUN_UPDATE_MARK = b'"method":"PATCH"'


def pending_counts(path: Path) -> tuple[int, int]:
    """Whole lines of ``path`` not yet acknowledged: the events among them, and the run updates."""
    offset = read_ack(path)
    lines = updates = 0
    carry = b""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for block in iter(lambda: f.read(1 << 20), b""):
                lines += block.count(b"\n")
                joined = carry + block
                updates += joined.count(_RUN_UPDATE_MARK)
                carry = joined[-(len(_RUN_UPDATE_MARK) - 1) :]
    except FileNotFoundError:
        return 0, 0
    return lines - updates, updates


def counted(events: int, updates: int) -> str:
    """``3 event(s)``, with the run updates (config, the end, process records) apart as they are no
    events: ``3 event(s) and 2 run update(s)``.

    >>> counted(1200, 0), counted(0, 2), counted(3, 1)
    ('1,200 event(s)', '2 run update(s)', '3 event(s) and 1 run update(s)')
    """
    if not updates:
        return f"{events:,} event(s)"
    return f"{events:,} event(s) and {updates:,} run update(s)" if events else f"{updates:,} run update(s)"


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
