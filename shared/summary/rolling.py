"""Rolling a run's levels up in the background as its events arrive (the rollup function's logic).

The metrics table's stream (on AWS) or the local database's change feed names every stored event;
from them come the steps of each run that changed. For each run, ``roll_up``:

- rolls up, at level 1, every step from the progress mark up to ``SETTLE_STEPS`` behind the newest
  step changed (the steps just written are still filling up with ranks: the summary reads them event by
  event), and again every step changed behind the mark (a rank that lagged, a spool replayed later);
- combines each coarser block above a step rolled up from the ten blocks below it (``rollups.combine``),
  level by level;
- then moves the mark: every event it read at a step up to the mark is now in every level.

A step's rollup is computed from all its stored events with the summary's own code (``decode``,
``units_from_run``), so a rolled block holds exactly the sums the summary would compute; writing one is
idempotent (the rollup that read more events wins), so a call may be repeated at any time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from shared import rollups
from shared.store.port import SummaryStore
from shared.summary.decoding import decode_steps

#: Steps behind the newest changed one that wait for their ranks before they are rolled up.
SETTLE_STEPS = 10
#: Events read at once (a chunk of whole steps): about 40 MB of decoded arrays.
CHUNK_EVENTS = 50_000
#: Changed steps further apart than this are read separately (not with the steps between them).
GAP_STEPS = 20


def touched_steps(changes: Iterable[tuple[str, str, int]]) -> dict[tuple[str, str], set[int]]:
    """The steps of each (project, run_id) that the given (project, run_id, step) changes touch."""
    touched: dict[tuple[str, str], set[int]] = {}
    for project, run_id, step in changes:
        touched.setdefault((project, run_id), set()).add(step)
    return touched


@dataclass(frozen=True)
class Rolled:
    blocks: int  # blocks written, every level
    events: int  # events read to do it
    through: int  # the progress mark after the call
    left: int  # steps due but left for another call (the time ran out): 0 when none


def roll_up(
    store: SummaryStore, project: str, run_id: str, steps: set[int], deadline: float | None = None
) -> Rolled:
    """Roll up what the changed ``steps`` make due, until ``deadline`` (monotonic); see the module."""
    progress = store.rollup_progress(project, run_id)
    mark = progress.step
    target = max(mark, max(steps) - SETTLE_STEPS)
    ranges = _ranges(sorted(s for s in steps if s <= mark))
    if target > mark:
        ranges.append((mark + 1, target))
    nodes = np.frombuffer(progress.nodes, "<i4").astype(np.int64)
    written = events_read = 0
    done_through = mark  # the new steps rolled up so far, in order
    for low, high in ranges:
        while low <= high:
            if deadline is not None and time.monotonic() > deadline:
                _advance(store, project, run_id, done_through, mark, nodes)
                return Rolled(written, events_read, max(mark, done_through), high - low + 1)
            page = store.read_events(project, run_id, low, high, CHUNK_EVENTS)
            through = high if page.complete_through is None else page.complete_through
            _, _, units, counts = decode_steps(page.events)
            if units is not None:
                level1 = _changed(store, project, run_id, rollups.roll_steps(units, counts))
                if level1:
                    store.write_blocks(project, run_id, level1)
                    steps_written = np.array([b.header.block for b in level1], np.int64)
                    written += len(level1) + _combine_parents(store, project, run_id, steps_written)
                events_read += len(page.events)
                nodes = rollups.merge_nodes(nodes, units.node_start)
            if low > mark:
                done_through = through
            low = through + 1
    _advance(store, project, run_id, done_through, mark, nodes, force=bool(ranges))
    return Rolled(written, events_read, max(mark, done_through), 0)


def _changed(
    store: SummaryStore, project: str, run_id: str, level1: list[rollups.RolledBlock]
) -> list[rollups.RolledBlock]:
    """The steps whose rollup would change: stored events are never removed, so a step rolled up from
    as many events as now is already right (several stream shards, or a feed batch and a late one,
    name the same steps: only the first roll writes, and only its blocks above are combined again)."""
    if not level1:
        return level1
    low, high = level1[0].header.block, level1[-1].header.block
    stored = {h.block: h.n_events for h in store.read_blocks(project, run_id, 1, low, high)}
    return [b for b in level1 if stored.get(b.header.block) != b.header.n_events]


def _combine_parents(store: SummaryStore, project: str, run_id: str, steps: np.ndarray) -> int:
    """Combine, level by level, the blocks above ``steps`` from the ten blocks below each."""
    written = 0
    for finer, size in zip(rollups.LEVELS, rollups.LEVELS[1:], strict=False):
        blocks = np.unique(steps // size).tolist()
        first, last = blocks[0] * (size // finer), (blocks[-1] + 1) * (size // finer) - 1
        headers = store.read_blocks(project, run_id, finer, first, last)
        if not headers:
            continue
        keys = list(dict.fromkeys(k for h in headers for k in h.keys))
        sums = store.read_block_sums(project, run_id, finer, keys, first, last)
        parts: dict[int, list[rollups.RolledBlock]] = {}
        for h in headers:
            block_sums = {key: sums[key][h.block] for key in h.keys if h.block in sums[key]}
            parts.setdefault(h.block * finer // size, []).append(rollups.RolledBlock(h, block_sums))
        combined = [rollups.combine(size, block, parts[block]) for block in blocks if block in parts]
        store.write_blocks(project, run_id, combined)
        written += len(combined)
    return written


def _ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps as ranges, steps at most ``GAP_STEPS`` apart read together."""
    ranges: list[tuple[int, int]] = []
    for step in steps:
        if ranges and step - ranges[-1][1] <= GAP_STEPS:
            ranges[-1] = (ranges[-1][0], step)
        else:
            ranges.append((step, step))
    return ranges


def _advance(
    store: SummaryStore,
    project: str,
    run_id: str,
    through: int,
    mark: int,
    nodes: np.ndarray,
    force: bool = False,
) -> None:
    if through > mark or force:
        store.advance_rollups(project, run_id, max(through, mark), nodes.astype("<i4").tobytes())
