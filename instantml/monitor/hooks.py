"""How a process's end is recorded without changing how it ends (contract 8).

One set of hooks per process, installed by the first ``im.init`` (signals only from the main thread):
SIGTERM, SIGINT and SIGHUP handlers, ``sys.excepthook`` and ``threading.excepthook``. Each records the end
on every open :class:`Lifecycle` of this process, waits at most ``INSTANTML_END_FLUSH_S`` (5 s) for what
they logged to be sent, then hands on to what was there before: the previous handler, or the default
action re-raised (the process then ends by that signal, its exit status unchanged). A signal that was
ignored stays ignored, and a handler installed outside Python (``getsignal`` gives None) is left alone.
A forked child (a DataLoader worker) inherits the handlers but is not the process they speak for: in it
they hand on at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from instantml import settings
from instantml.monitor import records

if TYPE_CHECKING:
    from instantml.upload.sinks import Sink

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def end_flush_s() -> float:
    try:
        return max(0.0, float(os.environ.get(settings.END_FLUSH_ENV, settings.DEFAULT_END_FLUSH_S)))
    except ValueError:
        return settings.DEFAULT_END_FLUSH_S


class Lifecycle:
    """One run's process records in this process: ``started`` at its first rank event, one ``ended``,
    and the beats of its :class:`~instantml.monitor.thread.Monitor`."""

    def __init__(self, sink: Sink, system_metrics: bool = True) -> None:
        self.sink = sink
        self.system_metrics = system_metrics  # the monitor samples this process's resources (contract 2)
        #: The monitor's latest sample, waiting for the main thread's next rank event to log it (the
        #: sinks' writers are the main thread's; the monitor never writes an event itself).
        self.sample: dict[str, float] | None = None
        self.who: dict[str, Any] | None = None
        self.step: int | None = None  # the latest step logged (set by Run.log_rank_metrics)
        self.ended = False
        self.thread_failure: dict[str, Any] | None = None
        self.monitor: Any = None
        _open.add(self)

    def start(self, rank: int, world_size: int, local_rank: int | None, step: int) -> None:
        from instantml.monitor.thread import Monitor

        self.who = records.identity(rank, world_size, local_rank)
        self.step = step
        self.sink.update_run(records.started(self.who, step))
        self.monitor = Monitor(self)
        self.monitor.start()

    def end(self, body: dict[str, Any] | None, flush_s: float = 0.0) -> None:
        """Record ``body`` (an ``ended`` record) once; with ``flush_s``, wait that long at most for what
        this run logged to be sent (the signal and exception paths: the process ends next)."""
        if self.ended:
            return
        self.ended = True
        _open.discard(self)
        if self.monitor is not None:
            self.monitor.stop()
        if self.who is None or body is None:
            return
        self.sink.update_run(body)
        if flush_s > 0:
            self.sink.flush(flush_s)

    def end_by(self, exc: BaseException, tb: TracebackType | None, flush_s: float = 0.0) -> None:
        if self.who is not None:
            self.end(records.ended_by(self.who, self.step, exc, tb), flush_s)
        else:
            self.end(None)

    def end_how(self, how: str, flush_s: float = 0.0, **detail: Any) -> None:
        self.end(None if self.who is None else records.ended(self.who, self.step, how, **detail), flush_s)


_open: weakref.WeakSet[Lifecycle] = weakref.WeakSet()
_installed_pid: int | None = None
_previous: dict[int, Any] = {}


def install() -> None:
    """Install this process's hooks once (again in a forked child that calls ``im.init`` itself)."""
    global _installed_pid
    if _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() == _installed_pid:
            for lifecycle in list(_open):
                lifecycle.end_by(exc, tb, end_flush_s())
        previous_hook(kind, exc, tb)

    def thread_excepthook(args: Any) -> None:
        if os.getpid() == _installed_pid and args.exc_type is not SystemExit:
            failure = records.thread_failure(args)
            for lifecycle in list(_open):
                lifecycle.thread_failure = failure
        previous_thread_hook(args)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    if threading.current_thread() is threading.main_thread():  # signal handlers: from the main thread only
        _install_signals()


def _install_signals() -> None:
    for name in SIGNALS:
        number = getattr(signal, name, None)
        if number is None:
            continue
        before = signal.getsignal(number)
        if before is None or before == signal.SIG_IGN:
            continue
        _previous[number] = before
        signal.signal(number, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _installed_pid:
        name = records.signal_name(signum)
        for lifecycle in list(_open):
            lifecycle.end_how("signal", end_flush_s(), signal=name)
    before = _previous.get(signum, signal.SIG_DFL)
    if callable(before):
        before(signum, frame)
        return
    # The default action, as if no handler had been installed: the process ends by this signal.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
