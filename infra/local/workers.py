"""Worker processes: each runs one function's handler, one invocation at a time, as a Lambda execution
environment does."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from infra.local.events import ARN_PREFIX, Handler, LambdaContext, load_handler

# Worker processes: each runs one function's handler, one invocation at a time, as a Lambda
# execution environment does (Powertools keeps the request being resolved in a class attribute, so
# one process must never resolve two at once).

_worker_handlers: dict[str, Handler] = {}


def leave_signals_to_the_stack() -> None:
    """Workers ignore Ctrl-C and SIGTERM: a terminal's Ctrl-C, `timeout` and process managers signal
    the whole process group, and a worker killed mid-request would lose its answer and break the pool
    the stack is stopping (its shutdown then waits forever). The stack stops them itself; if the stack
    is killed outright, ``_exit_with_parent`` ends them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


#: Allocations of container objects between the collector's young-generation passes (Python's default
#: is 700). A batch of 1,000 events allocates tens of thousands of dicts and tuples, nearly none of them
#: in cycles: at the default the collector ran every few dozen events and took a tenth of parsing.
GC_YOUNG_THRESHOLD = 50_000


def settle_gc() -> None:
    """Tune the cyclic garbage collector for a long-lived worker, once its imports are done: what they
    made is moved out of the collector's view (``gc.freeze``: full passes no longer walk it), and young
    passes run every ``GC_YOUNG_THRESHOLD`` allocations. Memory stays bounded: cycles are still
    collected, only less often."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _worker_start(environment: dict[str, str], function: str, dotted: str, parent: int, nice: int) -> None:
    leave_signals_to_the_stack()
    if nice:
        os.nice(nice)
    os.environ.update(environment)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    _worker_handlers[function] = load_handler(dotted)
    settle_gc()


def _exit_with_parent(parent: int) -> None:
    """A worker whose stack was killed (SIGKILL leaves no chance to stop it) exits within a second:
    everything it acknowledged is committed, and an orphan would only hold memory."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _worker_invoke(function: str, event: dict[str, Any], timeout_s: float, memory: int) -> dict[str, Any]:
    return _worker_handlers[function](
        event, LambdaContext(function, ARN_PREFIX + function, memory, timeout_s)
    )


def _worker_ready() -> int:
    return os.getpid()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Processes and threads started inside begin with SIGINT and SIGTERM blocked (a signal mask is
    inherited through fork and exec). Ctrl-C, `timeout` and process managers signal the stack's whole
    process group; a worker still importing when that came, before it could set them aside, died
    half-made, and a pool that loses a worker that way can hang the stack's stop. This thread gets
    them back when the block ends; a signal that came meanwhile is delivered then."""
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


#: How long a stop waits for background workers to finish their invocation before ending them.
BACKGROUND_STOP_S = 5.0


class FunctionWorkers:
    """A pool of worker processes for one function (spawned: nothing of this process is inherited)."""

    def __init__(
        self, function: str, props: dict[str, Any], environment: dict[str, str], size: int, nice: int = 0
    ) -> None:
        """``nice``: how much lower the workers' CPU priority is than the stack's (background work)."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.function = function
        self.background = nice > 0
        self._timeout = float(props.get("Timeout", 3))
        self._memory = int(props.get("MemorySize", 128))
        self._pool = ProcessPoolExecutor(
            size,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_start,
            initargs=(environment, function, props["Handler"], os.getpid(), nice),
        )
        self._warm = [self._pool.submit(_worker_ready) for _ in range(size)]

    def wait_ready(self) -> set[int]:
        """The worker pids, once every worker has imported its handler."""
        return {future.result(timeout=120) for future in self._warm}

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        future = self._pool.submit(_worker_invoke, self.function, event, self._timeout, self._memory)
        return future.result()

    def stop(self) -> None:
        """Stop once the invocations under way have answered: a request's worker holds an answer its
        client waits for. Background work (a watch round) is not waited for beyond
        ``BACKGROUND_STOP_S``: at its low priority on a busy machine a round can take minutes, and a
        round cut short changes nothing (its writes are transactions; the next start runs it again)."""
        if not self.background:
            self._pool.shutdown(wait=True, cancel_futures=True)
            return
        # ProcessPoolExecutor has no public way to end its workers before Python 3.14.
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + BACKGROUND_STOP_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()  # workers ignore SIGTERM (leave_signals_to_the_stack)
                process.join(5)
