"""Rolling a run's blocks up in the background as its events arrive (the rollup function's logic).

The metrics table's stream (on AWS) or the local database's change feed names every stored event;
from them come the (run, block) pairs that changed. The rule for each run:

- a block is rolled up once the run has an event in a later block: the run has moved past it;
- a block already rolled up is rolled up again whenever an event lands in it (a rank that lagged, a
  spool replayed hours later), so a rollup always ends up counting every stored event;
- the block being written is not rolled up: the summary reads it event by event.

A rollup reads its block's events from all shards and reduces them with the summary's own code
(``decode``, ``units_from_run``), so a rolled block holds exactly the sums the summary would compute.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from shared import rollups
from shared.decoding import decode, units_from_run
from shared.store.port import MetricsStore


def touched_blocks(changes: Iterable[tuple[str, str, int]]) -> dict[tuple[str, str], set[int]]:
    """The blocks of each (project, run_id) that the given (project, run_id, step) changes fall in."""
    touched: dict[tuple[str, str], set[int]] = {}
    for project, run_id, step in changes:
        touched.setdefault((project, run_id), set()).add(step // rollups.BLOCK_STEPS)
    return touched


@dataclass(frozen=True)
class Rolled:
    blocks: int  # blocks rolled up (written)
    events: int  # events read to do it
    through: int  # every block up to this one is rolled up
    left: int  # blocks due but left for the next call (the time ran out): 0 when none, else at least 1


def roll_up(
    store: MetricsStore, project: str, run_id: str, blocks: set[int], deadline: float | None = None
) -> Rolled:
    """Roll up what ``blocks`` (blocks that received events) make due, until ``deadline`` (monotonic).

    Due are the touched blocks already rolled up (rolled again) and the blocks between the progress
    mark and the newest touched block that hold events, found with ``next_step``: the work follows the
    events that exist, never the numeric range of the steps (a tokens-seen counter as the step leaves
    billions of empty block numbers between two events).
    """
    done = store.rolled_through(project, run_id)
    top = max(blocks)
    again = sorted(b for b in blocks if b <= done)
    written = events_read = 0

    def roll(block: int) -> None:
        nonlocal written, events_read
        rolled, n_events = roll_block(store, project, run_id, block)
        if rolled is not None:
            store.write_blocks(project, run_id, [rolled])
            written += 1
        events_read += n_events

    for index, block in enumerate(again):
        if _late(deadline):
            return Rolled(written, events_read, done, len(again) - index + int(done + 1 < top))
        roll(block)
    through = done
    while through + 1 < top:
        if _late(deadline):
            break
        step = store.next_step(
            project, run_id, (through + 1) * rollups.BLOCK_STEPS, top * rollups.BLOCK_STEPS - 1
        )
        if step is None:
            through = top - 1  # no events before the newest block: nothing more is due
            break
        block = step // rollups.BLOCK_STEPS
        roll(block)
        through = block  # the blocks between had no events when looked at
    if through > done:
        store.advance_rolled_through(project, run_id, through)
    return Rolled(written, events_read, through, int(through + 1 < top))


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def roll_block(
    store: MetricsStore, project: str, run_id: str, block: int
) -> tuple[rollups.RolledBlock | None, int]:
    """One block's rollup from all its stored events (None when it has none), and the events read."""
    first = block * rollups.BLOCK_STEPS
    events = store.read_events(project, run_id, first, first + rollups.BLOCK_STEPS - 1).events
    if not events:
        return None, 0
    run = decode(events)
    steps = np.unique(run.event_step)
    world_size = int(run.event_world_size.max())
    units = units_from_run(run, steps, np.zeros(len(steps), np.int64), 1, world_size)
    return rollups.roll_block(block, units, len(events)), len(events)
