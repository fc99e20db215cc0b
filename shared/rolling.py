"""Rolling a run's blocks up in the background as its events arrive (the rollup function's logic).

The metrics table's stream names the keys of every stored event; from them come the (run, block)
pairs that changed. The rule for each run:

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
from shared.rollup_store import RollupStore
from shared.store import MetricsStore, event_of_key
from shared.summary import decode, units_from_run


def touched_blocks(keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], set[int]]:
    """The blocks of each (project, run_id) that the given event item keys fall in."""
    touched: dict[tuple[str, str], set[int]] = {}
    for pk, sk in keys:
        event = event_of_key(pk, sk)
        if event is not None:
            project, run_id, step = event
            touched.setdefault((project, run_id), set()).add(step // rollups.BLOCK_STEPS)
    return touched


@dataclass(frozen=True)
class Rolled:
    blocks: int  # blocks rolled up (written)
    events: int  # events read to do it
    through: int  # every block up to this one is rolled up
    left: int  # blocks due but left for the next call (the time ran out)


def roll_up(
    store: MetricsStore, project: str, run_id: str, blocks: set[int], deadline: float | None = None
) -> Rolled:
    """Roll up what ``blocks`` (blocks that received events) make due, until ``deadline`` (monotonic)."""
    rollup_store = RollupStore(store)
    done = rollup_store.rolled_through(project, run_id)
    top = max(blocks)
    due = sorted({b for b in blocks if b <= done} | set(range(done + 1, top)))
    written = events_read = 0
    through = done
    for index, block in enumerate(due):
        if deadline is not None and time.monotonic() > deadline:
            if through > done:
                rollup_store.set_rolled_through(project, run_id, through)
            return Rolled(written, events_read, through, len(due) - index)
        rolled, n_events = roll_block(store, project, run_id, block)
        if rolled is not None:
            rollup_store.put(project, run_id, [rolled])
            written += 1
        events_read += n_events
        if block == through + 1:
            through = block
    if through > done:
        rollup_store.set_rolled_through(project, run_id, through)
    return Rolled(written, events_read, through, 0)


def roll_block(
    store: MetricsStore, project: str, run_id: str, block: int
) -> tuple[rollups.RolledBlock | None, int]:
    """One block's rollup from all its stored events (None when it has none), and the events read."""
    first = block * rollups.BLOCK_STEPS
    events = store.query_run(project, run_id, first, first + rollups.BLOCK_STEPS - 1)
    if not events:
        return None, 0
    run = decode(events)
    steps = np.unique(run.event_step)
    world_size = int(run.event_world_size.max())
    units = units_from_run(run, steps, np.zeros(len(steps), np.int64), 1, world_size)
    return rollups.roll_block(block, units, len(events)), len(events)
