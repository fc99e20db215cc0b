"""Noting accepted events on their run's record (``RunStore.note_activity``), so that listing runs
never reads events: what a batch says about its run (``activity``), and what this process last noted per
run (``ActivityNotes``), so that a batch that cannot change the record does not write it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from shared.errors import StoreThrottled, StoreUnavailable
from shared.events import Event, ScalarEvent
from shared.store.port import RunActivity, RunStore


def activity(events: Sequence[Event], now: float) -> RunActivity:
    """What accepted events, all of one kind (stored or replayed: noting twice changes nothing), say
    about their run: scalars only its time. Event times are the clients'; a clock ahead of the server's
    counts as now."""
    latest = min(max(e.time for e in events), now)
    if isinstance(events[0], ScalarEvent):
        return RunActivity(latest)
    step = max(e.step for e in events)
    at_step = [e for e in events if e.step == step]
    return RunActivity(latest, step, frozenset(e.rank for e in at_step), max(e.world_size for e in at_step))


#: ``last_event`` is kept to this resolution: a process notes a run's time at most once a second.
ACTIVITY_RESOLUTION_S = 1.0
#: Runs whose last note a process remembers.
NOTED_RUNS = 10_000

_V = TypeVar("_V")


def remember(notes: dict[tuple[str, str], _V], key: tuple[str, str], value: _V) -> None:
    """Keep ``value`` as the run's newest note, and forget the run noted longest ago beyond ``NOTED_RUNS``
    (a dict keeps its order of insertion: the first key is the oldest)."""
    notes.pop(key, None)
    notes[key] = value
    if len(notes) > NOTED_RUNS:
        del notes[next(iter(notes))]


class _Noted(NamedTuple):
    """A run's record as this process last noted it, its ranks as a bit mask (512 ranks: 64 bytes, where
    a set of them takes 30 KB, times ``NOTED_RUNS``)."""

    time: float
    step: int | None
    ranks: int
    world_size: int | None


def _bits(ranks: frozenset[int]) -> int:
    bits = 0
    for rank in ranks:
        bits |= 1 << rank
    return bits


class ActivityNotes:
    """What this process last noted per run, so that a batch that cannot change a run's record does not
    write it: a replayed or late batch, a rank already noted at the newest step, a time within a second.
    Only what the store acknowledged is remembered, and the store's record only grows, so a skipped note
    never loses anything but a sub-second ``last_event``.

    ``hold_time_s`` (the store's ``run_time_resolution_s``): a note whose step part is new but whose
    time is within that long of the time this process noted carries the noted time instead, so a store
    that keeps the run's time on one hot item (DynamoDB, where both runs indexes hold it) writes that
    item about once a second per process, however many ranks report; the step part is written as it
    comes. 0 keeps every time as it comes.

    A note the store throttles or fails is kept and folded into the run's next note (``merge``): the
    events it came with are stored, so their request must not be answered 429 or 503 for it."""

    def __init__(self, hold_time_s: float = 0.0) -> None:
        self._noted: dict[tuple[str, str], _Noted] = {}
        self._pending: dict[tuple[str, str], RunActivity] = {}
        self.hold_time_s = hold_time_s

    def note_events(
        self, store: RunStore, project: str, run_id: str, events: Sequence[Event], now: float
    ) -> bool:
        """``note`` the ``activity`` of accepted events."""
        return self.note(store, project, run_id, activity(events, now))

    def note(self, store: RunStore, project: str, run_id: str, new: RunActivity) -> bool:
        """Note ``new`` (with what is pending for the run); False when the store refused it, which then
        waits for the run's next note."""
        key = (project, run_id)
        pending = self._pending.pop(key, None)
        if pending is not None:
            new = merge(pending, new)
        old = self._noted.get(key)
        bits = _bits(new.ranks)
        if old is not None and pending is None and _adds_nothing(old, new, bits):
            return True
        if self.hold_time_s > 0 and old is not None and new.time <= old.time + self.hold_time_s:
            new = new._replace(time=min(new.time, old.time))
        try:
            store.note_activity(project, run_id, new)
        except (StoreThrottled, StoreUnavailable):
            remember(self._pending, key, new)
            return False
        noted = _Noted(new.time, new.step, bits, new.world_size)
        if old is not None:
            if old.step is not None and (new.step is None or new.step < old.step):
                noted = old._replace(time=new.time)
            elif new.step is not None and new.step == old.step:
                sizes = [s for s in (old.world_size, new.world_size) if s is not None]
                noted = noted._replace(ranks=old.ranks | bits, world_size=max(sizes) if sizes else None)
            noted = noted._replace(time=max(noted.time, old.time))
        remember(self._noted, key, noted)
        return True


def merge(a: RunActivity, b: RunActivity) -> RunActivity:
    """One activity that notes what ``a`` and ``b`` each would (noting is a merge that only grows)."""
    time = max(a.time, b.time)
    if a.step is None and b.step is None:
        return a._replace(time=time)
    if a.step is None or (b.step is not None and b.step > a.step):
        return b._replace(time=time)
    if b.step is None or b.step < a.step:
        return a._replace(time=time)
    sizes = [s for s in (a.world_size, b.world_size) if s is not None]
    return RunActivity(time, a.step, a.ranks | b.ranks, max(sizes) if sizes else None)


def _adds_nothing(old: _Noted, new: RunActivity, bits: int) -> bool:
    if new.time > old.time + ACTIVITY_RESOLUTION_S:
        return False
    if new.step is None or (old.step is not None and new.step < old.step):
        return True
    if old.step is None or new.step > old.step:
        return False
    return bits & ~old.ranks == 0 and (new.world_size or 0) <= (old.world_size or 0)
