"""Process records (contract 8) as the run update bodies that carry them: ``{"process": {...}, "time": t}``.

Pure: values in, JSON-ready dicts out. Every text is bounded (``limits.MAX_PROCESS_TEXT``, a stack at most
``limits.MAX_STACK_BYTES``), so a record always fits a run update.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import sysconfig
import time
import traceback
from types import FrameType, TracebackType
from typing import Any

from instantml import limits

#: Launchers' restart counters: torchrun's elastic agent, SLURM's requeue.
ATTEMPT_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: Frames kept of a stack, innermost last.
STACK_FRAMES = 24


def attempt(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """This process's attempt: how many times its launcher restarted the job before it (0: the first).

    >>> attempt({"TORCHELASTIC_RESTART_COUNT": "2"})
    2
    """
    for name in ATTEMPT_VARIABLES:
        text = environ.get(name, "").strip()
        if text.isdigit():
            return int(text)
    return 0


def _text(value: str) -> str:
    value = value.encode("utf-8", "backslashreplace").decode()
    return value if len(value) <= limits.MAX_PROCESS_TEXT else value[: limits.MAX_PROCESS_TEXT - 3] + "..."


@functools.cache
def _library_paths() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    found.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # instantml itself
    return tuple(sorted(os.path.join(p, "") for p in found))


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's code: not Python's, not an installed package's, not ours."""
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_library_paths())


def where(filename: str, line: int | None, function: str) -> str:
    return _text(f"{filename}:{line} {function}")


def stack_of(frame: FrameType | None) -> list[str]:
    """A thread's stack as ``file:line function`` lines, innermost last, no locals; at most
    ``STACK_FRAMES`` frames and ``limits.MAX_STACK_BYTES`` (the innermost kept)."""
    if frame is None:
        return []
    lines = [where(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame, STACK_FRAMES)]
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        size += len(line.encode()) + 4
        if size > limits.MAX_STACK_BYTES:
            break
        kept.append(line)
    return kept[::-1]


def innermost_user_frame(tb: TracebackType | None) -> str | None:
    """The innermost frame of the user's code in a traceback (else its innermost frame)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    for frame in reversed(frames):
        if is_user_file(frame.filename):
            return where(frame.filename, frame.lineno, frame.name)
    return where(frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None


def _body(process: dict[str, Any]) -> dict[str, Any]:
    return {"process": process, "time": time.time()}


def identity(rank: int, world_size: int, local_rank: int | None) -> dict[str, Any]:
    """What names one process of a run: its rank, its world, its pid and its attempt (each record
    carries it, so any one of them is enough for the server to know the process)."""
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "pid": os.getpid(),
        "attempt": attempt(),
    }


def started(who: dict[str, Any], first_step: int) -> dict[str, Any]:
    host = socket.gethostname()
    return _body(
        {
            **who,
            "state": "started",
            "host": host if limits.is_valid_host(host) else None,
            "first_step": first_step,
        }
    )


def ended(who: dict[str, Any], step: int | None, how: str, **detail: Any) -> dict[str, Any]:
    """``how``: ``finished``, ``exception`` (``exception={type, message, where}``), ``signal``
    (``signal="SIGTERM"``) or ``exit`` (``code``)."""
    return _body({**who, "state": "ended", "step": step, "how": how, **detail})


def exception_detail(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    """An exception as an ``ended`` record says it: its type, the first line of its message, and the
    innermost frame of the user's code."""
    message = str(exc).strip().splitlines()
    return {
        "type": _text(type(exc).__qualname__),
        "message": _text(message[0]) if message else "",
        "where": innermost_user_frame(tb),
    }


def ended_by(
    who: dict[str, Any], step: int | None, exc: BaseException, tb: TracebackType | None
) -> dict[str, Any]:
    """The ``ended`` record of a process left by ``exc``: ``exit`` for ``SystemExit`` (its code),
    ``signal`` SIGINT for ``KeyboardInterrupt``, else ``exception``."""
    if isinstance(exc, SystemExit):
        code = exc.code
        return ended(who, step, "exit", code=code if isinstance(code, int) else (0 if code is None else 1))
    if isinstance(exc, KeyboardInterrupt):
        return ended(who, step, "signal", signal="SIGINT")
    return ended(who, step, "exception", exception=exception_detail(exc, tb))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def beat(
    who: dict[str, Any], step: int | None, silent_s: float, stack: list[str] | None, every: float
) -> dict[str, Any]:
    """A liveness beat of a process whose main thread has not logged for ``silent_s`` seconds; the next
    comes ``every`` seconds later while it stays silent."""
    process: dict[str, Any] = {
        **who,
        "state": "beat",
        "step": step,
        "silent_s": round(silent_s, 1),
        "every": every,
    }
    if stack is not None:
        process["stack"] = stack
    return _body(process)


def thread_failure(args: Any) -> dict[str, Any]:
    """What a beat says of a thread that died of an exception (``threading.excepthook``'s ``args``)."""
    name = getattr(args.thread, "name", None) or "a thread"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    return {"thread": _text(str(name)), **exception_detail(exc, args.exc_traceback)}


def main_stack() -> list[str]:
    """The main thread's current stack (from another thread)."""
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return stack_of(frame)
