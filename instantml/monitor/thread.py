"""The monitor thread (contract 8): idle while the main thread logs; when it has not logged for longer
than max(``INSTANTML_BEAT_S`` (30 s), 5 x its step interval), a beat with its stack, then one per
``INSTANTML_BEAT_S`` while it stays silent.

It only reads the step the main thread last logged (``Lifecycle.step``, one attribute store on the hot
path), once a second: its cost is a wake-up per second. Every ``INSTANTML_SYSTEM_INTERVAL_S`` (10 s) it
also samples the process's system metrics (contract 2, ``instantml.monitor.system``), only when the main
thread has logged a step since the last sample, and leaves the sample on ``Lifecycle.sample``; the main
thread's next ``log_rank_metrics`` logs it as a rank event of its own at that call's step, through its
sink (the sinks' writers stay the main thread's: the spool writer's caches are not shared with this
thread). So a silent process never looks alive by its samples, and no step holds two samples of a rank.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from typing import Any, Protocol

from instantml import settings
from instantml.monitor import records, system


class Watched(Protocol):
    """What the monitor reads of a process's lifecycle (``instantml.monitor.hooks.Lifecycle``)."""

    step: int | None
    who: dict[str, Any] | None
    ended: bool
    thread_failure: dict[str, Any] | None
    sink: Any
    system_metrics: bool
    sample: dict[str, float] | None


#: Step intervals whose median sets the silence bar.
KEPT_INTERVALS = 32
#: A silence is that many step intervals, at least the beat interval.
SILENT_INTERVALS = 5.0


def beat_s() -> float:
    try:
        return max(0.1, float(os.environ.get(settings.BEAT_ENV, settings.DEFAULT_BEAT_S)))
    except ValueError:
        return settings.DEFAULT_BEAT_S


class Monitor(threading.Thread):
    def __init__(self, lifecycle: Watched) -> None:
        super().__init__(name="instantml-monitor", daemon=True)
        self.lifecycle = lifecycle
        self.every = beat_s()
        self.stacks = os.environ.get(settings.STACKS_ENV, "1").strip() != "0"
        self._stopped = threading.Event()
        self.beats = 0
        #: Seconds between system samples (None: off), the sampler (made on this thread, once it runs).
        self.sample_every = system.interval_s() if lifecycle.system_metrics else None
        self.samples = 0
        self._sampled_step: int | None = None

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        lifecycle = self.lifecycle
        tick = min(1.0, self.every / 10, (self.sample_every or 10.0) / 5)
        step = lifecycle.step
        changed = time.monotonic()
        intervals: deque[float] = deque(maxlen=KEPT_INTERVALS)
        last_beat: float | None = None
        sampler = self._sampler()
        next_sample = changed + (self.sample_every or 0.0)
        while not self._stopped.wait(tick):
            now = time.monotonic()
            if sampler is not None and now >= next_sample:
                next_sample = now + (self.sample_every or 0.0)
                if not self._sample(sampler):
                    sampler = None
            if lifecycle.step != step:
                intervals.append(now - changed)
                step, changed, last_beat = lifecycle.step, now, None
                continue
            silent = now - changed
            bar = max(self.every, SILENT_INTERVALS * (statistics.median(intervals) if intervals else 0.0))
            if silent < bar or (last_beat is not None and now - last_beat < self.every):
                continue
            who = lifecycle.who
            if who is None or lifecycle.ended:
                return
            body = records.beat(who, step, silent, records.main_stack() if self.stacks else None, self.every)
            if lifecycle.thread_failure is not None:
                body["process"]["thread_failure"] = lifecycle.thread_failure
            lifecycle.sink.update_run(body)
            self.beats += 1
            last_beat = now

    def _sampler(self) -> system.Sampler | None:
        if self.sample_every is None:
            return None
        who = self.lifecycle.who or {}
        try:
            return system.Sampler(who.get("local_rank"))
        except Exception:  # noqa: BLE001 - (sampling must never stop the beats: it stays off)
            return None

    def _sample(self, sampler: system.Sampler) -> bool:
        """One sample for the main thread to log, if it logged a step since the last sample; False once
        sampling failed (it then stays off for this process, the beats go on)."""
        lifecycle = self.lifecycle
        who, step = lifecycle.who, lifecycle.step
        if who is None or lifecycle.ended or step is None or step == self._sampled_step:
            return True
        try:
            values = sampler.sample()
        except Exception:  # noqa: BLE001
            return False
        if values:
            lifecycle.sample = values
        self._sampled_step = step
        self.samples += 1
        return True
