"""Stopping the stack does not wait for background work: a watch round at its low priority can take
minutes on a busy machine, and Ctrl-C must still stop the stack (CI saw a stop outlast 60 s)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

from infra.local import FunctionWorkers
from infra.local.workers import BACKGROUND_STOP_S
from tests.faults import wait_for

SLOW = {"Handler": "tests.stack.slow_function.lambda_handler", "Timeout": 900}


def test_a_background_round_under_way_is_ended_and_the_stop_returns(tmp_path: Path) -> None:
    workers = FunctionWorkers("SlowFunction", SLOW, {}, 1, nice=1)
    workers.wait_ready()
    started = tmp_path / "started"
    threading.Thread(target=lambda: _ignore(workers, str(started)), daemon=True).start()
    wait_for(started.exists, 60, "the round to start")
    pids = {p.pid for p in workers._pool._processes.values()}

    began = time.monotonic()
    workers.stop()

    assert time.monotonic() - began < BACKGROUND_STOP_S + 30
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def _ignore(workers: FunctionWorkers, started: str) -> None:
    with contextlib.suppress(Exception):  # the round is ended on purpose
        workers.invoke({"started": started})
