"""A run's Distributed summary read through the store port (``distributed_summary``): the level of
rollups that serves the window, its blocks, the events after the rollups' progress mark (and the steps
a late rank reached behind it), made into units and summarized by ``shared.summary.document``. The summary
never writes."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from shared import rollups
from shared.findings import Finding
from shared.store.port import SummaryStore
from shared.summary.decoding import decode_steps
from shared.summary.document import Resolution, Summary, summarize_units
from shared.summary.query import SummaryQuery

#: At most about this many events are read per summary (a store may set fewer: ``raw_read_budget``); a
#: window with more events beyond the rollups' progress mark is summarized up to where the reading
#: stopped, and says so (``resolution.complete_through_step`` and a ``partial`` finding).
RAW_READ_BUDGET = 400_000
#: At most this many steps that a late rank's events reached after they were rolled up are read event
#: by event (``late_steps``); beyond them a summary shows the blocks as rolled until the rollups catch up.
LATE_STEPS_READ = 2_000


def distributed_summary(
    store: SummaryStore,
    project: str,
    run_id: str,
    query: SummaryQuery,
    arrays: bool = False,
) -> Summary | None:
    """Read the run's window from the store and summarize it; None if it has no events.

    One path for any window: the level whose blocks give at least ``max_steps`` columns over the window
    (``level_size``; single steps for a short window) is read, finer blocks where the window's ends cut
    a block, and the steps after the rollups' progress mark (the newest, still filling up with ranks)
    event by event, at most ``raw_read_budget(store)`` of them. A column is a group of those units, exact for
    the steps it claims. The summary itself never writes.
    """
    progress = store.rollup_progress(project, run_id)
    low, high = query.step_min or 0, query.step_max
    rolled_high = progress.step if high is None else min(high, progress.step)
    events, through = [], None
    late = store.late_steps(project, run_id, low, rolled_high, LATE_STEPS_READ) if low <= rolled_high else []
    for a, b in _runs_of(late):  # rolled up before a late rank's events came: read as events
        events += store.read_events(project, run_id, a, b).events
    tail_low = max(low, progress.step + 1)
    if high is None or tail_low <= high:
        page = store.read_events(project, run_id, tail_low, high, raw_read_budget(store))
        events, through = events + page.events, page.complete_through
    first = store.next_step(project, run_id, low, rolled_high) if low <= rolled_high else None
    if first is None and not events:
        return None
    run, tail_steps, step_units, counts = decode_steps(events)
    span_first = first if first is not None else int(run.event_step.min())
    span_last = max(int(run.event_step.max()) if events else -1, rolled_high if first is not None else -1)
    size = level_size(span_last - span_first + 1, query.max_steps)
    while True:  # a finer level while a coarser one merges steps into fewer than max_steps units
        headers = [] if first is None else _cover(store, project, run_id, first, rolled_high, size, late)
        unit_ids = {h.first_step // size for h in headers} | set((tail_steps // size).tolist())
        distinct = sum(h.n_steps for h in headers) + len(tail_steps)
        if size == 1 or len(unit_ids) >= query.max_steps or len(unit_ids) == distinct:
            break
        size //= 10
    all_keys = set(run.keys).union(*(h.keys for h in headers))
    keys = [k for k in (query.keys or sorted(all_keys)) if k in all_keys]
    pieces = _with_sums(store, project, run_id, headers, keys)
    if step_units is not None:
        pieces += rollups.roll_steps(step_units, counts)
        nodes = step_units.node_start
    else:
        nodes = np.zeros(0, np.int64)
    stored_nodes = np.frombuffer(progress.nodes, "<i4").astype(np.int64)
    units = _units(pieces, size, keys, rollups.merge_nodes(stored_nodes, nodes))
    resolution: Resolution = {
        "unit": "step" if size == 1 else "level",
        "level_steps": size,
        "rollup_blocks_read": len(headers),
        "events_read": len(events),
        "late_steps_read": len(late),
        "complete_through_step": through,
    }
    summary = summarize_units(units, keys, project, run_id, query, resolution, arrays)
    if through is not None:
        summary["findings"].append(_partial_finding(through))
    return summary


def raw_read_budget(store: SummaryStore) -> int:
    """The most events a summary reads one by one from ``store``: ``RAW_READ_BUDGET``, or less where
    the store says its reads cost more (``raw_read_budget``: DynamoDB's items are parsed by botocore)."""
    return min(RAW_READ_BUDGET, getattr(store, "raw_read_budget", RAW_READ_BUDGET))


def level_size(span: int, max_steps: int) -> int:
    """The coarsest level whose blocks cut ``span`` steps into at least ``max_steps`` units (1: steps);
    with sparse steps the summary goes finer until its units are as many as it can have."""
    return max([s for s in rollups.LEVELS if span // s >= max_steps], default=1)


def _runs_of(steps: list[int]) -> list[tuple[int, int]]:
    """Ascending steps as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for step in steps:
        if runs and runs[-1][1] == step - 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


def _cover(
    store: SummaryStore, project: str, run_id: str, low: int, high: int, size: int, holes: list[int]
) -> list[rollups.BlockHeader]:
    """The rolled blocks that tile the steps ``low..high`` but ``holes`` (ascending steps read as
    events): blocks of ``size`` inside it, and where its ends or a hole cut a block, the finer blocks
    inside it (a block absent at one level has no events, so its parts are not looked for)."""
    chosen: list[rollups.BlockHeader] = []
    pending, start = [], low
    for a, b in _runs_of(holes):
        if start < a:
            pending.append((start, a - 1))
        start = b + 1
    if start <= high:
        pending.append((start, high))
    for level in reversed(rollups.LEVELS[: rollups.LEVELS.index(size) + 1]):
        finer = []
        for a, b in pending:
            for h in store.read_blocks(project, run_id, level, a // level, b // level):
                start, end = h.block * level, h.block * level + level - 1
                if a <= start and end <= b:
                    chosen.append(h)
                else:
                    finer.append((max(a, start), min(b, end)))
        pending = finer
    return chosen


def _with_sums(
    store: SummaryStore, project: str, run_id: str, headers: list[rollups.BlockHeader], keys: list[str]
) -> list[rollups.RolledBlock]:
    """The blocks with their sums of ``keys``, read per level and per run of consecutive blocks."""
    pieces = []
    by_level: dict[int, list[rollups.BlockHeader]] = {}
    for h in headers:
        by_level.setdefault(h.size, []).append(h)
    for size, group in by_level.items():
        group.sort(key=lambda h: h.block)
        runs: list[list[rollups.BlockHeader]] = []
        for h in group:
            if runs and h.block - runs[-1][-1].block <= 10:
                runs[-1].append(h)
            else:
                runs.append([h])
        for part in runs:
            sums = store.read_block_sums(project, run_id, size, keys, part[0].block, part[-1].block)
            for h in part:
                block_sums = {key: sums[key][h.block] for key in keys if h.block in sums[key]}
                pieces.append(rollups.RolledBlock(h, block_sums))
    return pieces


def _units(
    pieces: list[rollups.RolledBlock], size: int, keys: list[str], nodes: NDArray[np.int64]
) -> rollups.Units:
    """Units of ``size`` steps (one per block of that level holding events) from the pieces inside them."""
    by_unit: dict[int, list[rollups.RolledBlock]] = {}
    for piece in pieces:
        by_unit.setdefault(piece.header.first_step // size, []).append(piece)
    order = sorted(by_unit)
    blocks = [
        parts[0] if len(parts) == 1 else rollups.combine(size, unit, parts)
        for unit, parts in ((u, by_unit[u]) for u in order)
    ]
    n = len(blocks)
    heads = [b.header for b in blocks]
    ws = max([h.world_size for h in heads] + [len(nodes)], default=0)
    shape = (ws, n)
    fields = ("present", "first", "last", "lead", "span")
    if all(h.world_size == ws for h in heads) and n:  # one world size: whole arrays at once
        present, first, last, lead, span = (np.stack([getattr(h, f) for h in heads], axis=1) for f in fields)
    else:
        present, lead, span = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        first, last = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
        for u, h in enumerate(heads):
            w = h.world_size
            present[:w, u], first[:w, u], last[:w, u], lead[:w, u], span[:w, u] = (
                getattr(h, f) for f in fields
            )
    key_units = {key: _key_units([b.sums.get(key) for b in blocks], ws) for key in keys}
    world = np.array([h.world_size for h in heads], np.int64)
    steps = np.array([h.first_step for h in heads], np.int64)
    units = rollups.Units(
        first_step=steps,
        last_step=np.array([h.last_step for h in heads], np.int64),
        n_steps=np.array([h.n_steps for h in heads], np.int64),
        world_size=world,
        present=present,
        keys=key_units,
        rank_first=first,
        rank_last=last,
        node_start=np.concatenate([nodes, np.full(ws - len(nodes), -1, np.int64)]) if len(nodes) else nodes,
    )
    if size == 1:  # single steps: coverage is judged step by step
        units.raw_steps, units.raw_present, units.raw_world_size = steps, present > 0, world
    else:
        units.rolled = np.ones(n, bool)
        units.rank_lead, units.rank_span = lead, span
        units.raw_present = np.zeros((ws, 0), bool)
    return units


def _key_units(packed: list[bytes | None], ws: int) -> rollups.KeyUnits:
    """One key's sums (ranks x units) from each unit's packed sums (None: the key is not in it): one
    ``frombuffer`` when every unit holds all ``ws`` ranks, else unit by unit."""
    n = len(packed)
    size = rollups.KEY_UNIT_BYTES * ws
    if n and all(p is not None and len(p) == size for p in packed):
        raw = np.frombuffer(b"".join(packed), np.uint8).reshape(n, size)  # type: ignore[arg-type]

        def part(start: int, width: int, dtype: str) -> NDArray[Any]:
            return np.ascontiguousarray(raw[:, start * ws : (start + width) * ws]).view(dtype).T

        return rollups.KeyUnits(
            part(0, 8, "<f8").astype(np.float64),
            part(16, 4, "<u4").astype(np.int64),
            part(8, 8, "<f8").astype(np.float64),
            part(20, 4, "<u4").astype(np.int64),
        )
    shape = (ws, n)
    k = rollups.KeyUnits(
        np.zeros(shape), np.zeros(shape, np.int64), np.zeros(shape), np.zeros(shape, np.int64)
    )
    for u, one in enumerate(packed):
        if one is not None:
            k.total[:, u], k.count[:, u], k.weight[:, u], k.nonfinite[:, u] = rollups.unpack_key_units(
                one, ws
            )
    return k


def _partial_finding(through: int) -> Finding:
    return {
        "kind": "partial",
        "rank": None,
        "key": None,
        "step": through,
        "severity": "info",
        "message": f"this summary covers the run through step {through}: the rest has too many events "
        "not rolled up yet to read at once; it is being rolled up in the background, reload to see more",
    }
