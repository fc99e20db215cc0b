"""Stored events to arrays: a run's values flattened per (event, key) with the contract's tie rule, and
summed into units (steps or blocks of steps). Pure numpy, no I/O: the summary, the rollups and the
``run.log`` series all read events through here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from shared import rollups
from shared.store.port import StoredEvent


@dataclass
class DecodedRun:
    """A run's values flattened to one entry per (event, key), newest event per (key, step, rank)."""

    keys: list[str]
    key_id: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    step: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    rank: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    value: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    weight: NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    # per event, for coverage:
    event_step: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    event_rank: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    event_world_size: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    event_node: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))  # -1: unknown


def decode(events: list[StoredEvent]) -> DecodedRun:
    """Stored items to flat arrays: the packed values of all events are joined and read with one
    ``frombuffer``; the per-event Python work is a few attribute reads.

    When two events carry the same (step, rank, key), the later ``time`` wins, ties to the larger
    event id (contract 6).
    """
    key_index: dict[str, int] = {}
    ids_of_list: dict[int, NDArray[np.int64]] = {}  # id() of an event's key list -> key ids
    ids_of_joined: dict[str, NDArray[np.int64]] = {}
    ids = []
    for event in events:
        ids_for_item = ids_of_list.get(id(event.keys))
        if ids_for_item is None:
            joined = "\n".join(event.keys)
            ids_for_item = ids_of_joined.get(joined)
            if ids_for_item is None:
                ids_for_item = np.array(
                    [key_index.setdefault(k, len(key_index)) for k in event.keys], np.int64
                )
                ids_of_joined[joined] = ids_for_item
            ids_of_list[id(event.keys)] = ids_for_item
        ids.append(ids_for_item)
    keys = list(key_index)
    if not events:
        return DecodedRun(keys)
    n = len(events)
    n_values = np.fromiter(map(len, ids), np.int64, n)
    event_step = np.fromiter((e.step for e in events), np.int64, n)
    event_rank = np.fromiter((e.rank for e in events), np.int64, n)
    event_ws = np.fromiter((e.world_size for e in events), np.int64, n)
    local = np.fromiter((-1 if e.local_rank is None else e.local_rank for e in events), np.int64, n)
    event_node = np.where(local >= 0, event_rank - local, -1)
    flat = np.frombuffer(b"".join([e.packed for e in events]), "<f8")
    starts = np.zeros(n, np.int64)
    np.cumsum(n_values[:-1] + 2, out=starts[1:])
    is_value = np.ones(len(flat), bool)
    is_value[starts] = is_value[starts + 1] = False
    values = flat[is_value]
    key_id = np.concatenate(ids)
    step = np.repeat(event_step, n_values)
    rank = np.repeat(event_rank, n_values)
    weight = np.repeat(flat[starts], n_values)
    # Two events at one (step, rank) are rare (a reused id, a second writer): only then do time and
    # event id decide which values are kept.
    by_pair = np.lexsort((event_rank, event_step))
    repeated = bool(
        np.any(
            (event_step[by_pair][1:] == event_step[by_pair][:-1])
            & (event_rank[by_pair][1:] == event_rank[by_pair][:-1])
        )
    )
    if repeated:
        time = np.repeat(flat[starts + 1], n_values)
        _, id_order = np.unique(np.array([e.event_id for e in events]), return_inverse=True)
        event_order = np.repeat(id_order, n_values)
        # Sort so that within each (key, step, rank) group the winner comes last, then keep the last.
        order = np.lexsort((event_order, time, rank, step, key_id))
        k, s, r = key_id[order], step[order], rank[order]
        last = np.ones(len(order), bool)
        last[:-1] = (k[1:] != k[:-1]) | (s[1:] != s[:-1]) | (r[1:] != r[:-1])
        keep = order[last]
    else:
        keep = np.lexsort((rank, step, key_id))
    return DecodedRun(
        keys=keys,
        key_id=key_id[keep],
        step=step[keep],
        rank=rank[keep],
        value=values[keep],
        weight=weight[keep],
        event_step=event_step,
        event_rank=event_rank,
        event_world_size=event_ws,
        event_node=event_node,
    )


def accumulate(
    rows: NDArray[np.int64],
    cols: NDArray[np.int64],
    shape: tuple[int, int],
    values: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """``out[rows, cols] += values`` (or += 1) with repeated indices, via one ``bincount``.

    A sum of nothing but -0.0 is -0.0, as IEEE addition gives (``bincount`` starts from +0.0): a rank
    that logged -0.0 shows -0.0."""
    index = rows * shape[1] + cols
    flat = np.bincount(index, weights=values, minlength=shape[0] * shape[1])
    if values is not None:
        negative_zero = (values == 0) & np.signbit(values)
        if negative_zero.any():
            only = np.bincount(index, weights=negative_zero, minlength=len(flat)) == np.bincount(
                index, minlength=len(flat)
            )
            flat[(flat == 0) & only] = -0.0
    return flat.reshape(shape).astype(np.float64)


def units_from_run(
    run: DecodedRun, steps: NDArray[np.int64], unit_of_step: NDArray[np.int64], n_units: int, world_size: int
) -> rollups.Units:
    """Sum a decoded run's values into units: ``unit_of_step[i]`` is the unit of ``steps[i]``.

    ``steps`` are the distinct steps of the window; with ``unit_of_step = arange`` each step is a unit.
    """
    n_steps = len(steps)
    in_window = np.isin(run.event_step, steps)
    step_index = np.searchsorted(steps, run.event_step[in_window])
    event_rank = run.event_rank[in_window]
    raw_present = np.zeros((world_size, n_steps), bool)
    raw_present[event_rank, step_index] = True
    step_ws = np.zeros(n_steps, np.int64)
    np.maximum.at(step_ws, step_index, run.event_world_size[in_window])
    unit_ws = np.zeros(n_units, np.int64)
    np.maximum.at(unit_ws, unit_of_step, step_ws)
    rows, units = np.nonzero(raw_present)
    present = accumulate(rows, unit_of_step[units], (world_size, n_units)).astype(np.int64)
    n_in_unit = np.bincount(unit_of_step, minlength=n_units).astype(np.int64)
    first = np.full(n_units, -1, np.int64)
    last = np.full(n_units, -1, np.int64)
    first[unit_of_step[::-1]] = steps[::-1]  # the smallest step of each unit is written last
    last[unit_of_step] = steps

    # Each rank's first and last step in each unit: ``nonzero`` walks ranks, then steps in order.
    flat = rows * n_units + unit_of_step[units]
    rank_first = np.full(world_size * n_units, -1, np.int64)
    rank_last = np.full(world_size * n_units, -1, np.int64)
    rank_first[flat[::-1]] = steps[units][::-1]
    rank_last[flat] = steps[units]

    keys: dict[str, rollups.KeyUnits] = {}
    value_in_window = np.isin(run.step, steps)
    value_unit = np.full(len(run.step), -1, np.int64)
    value_unit[value_in_window] = unit_of_step[np.searchsorted(steps, run.step[value_in_window])]
    for kid, key in enumerate(run.keys):
        sel = (run.key_id == kid) & value_in_window
        r, u, x = run.rank[sel], value_unit[sel], run.value[sel]
        ok = np.isfinite(x)
        shape = (world_size, n_units)
        keys[key] = rollups.KeyUnits(
            total=accumulate(r[ok], u[ok], shape, x[ok]),
            count=accumulate(r[ok], u[ok], shape).astype(np.int64),
            weight=accumulate(r[ok], u[ok], shape, run.weight[sel][ok]),
            nonfinite=accumulate(r[~ok], u[~ok], shape).astype(np.int64),
        )
    node_start = np.full(world_size, -1, np.int64)
    if len(run.event_node):
        known = run.event_node >= 0
        node_start[run.event_rank[known]] = run.event_node[known]
    return rollups.Units(
        first,
        last,
        n_in_unit,
        unit_ws,
        present,
        keys,
        rank_first=rank_first.reshape(world_size, n_units),
        rank_last=rank_last.reshape(world_size, n_units),
        raw_steps=steps.astype(np.int64),
        raw_present=raw_present,
        raw_world_size=step_ws,
        node_start=node_start,
    )


class StepUnits(NamedTuple):
    """Events decoded, and cut into one unit per distinct step (what a level-1 rollup block holds)."""

    run: DecodedRun
    steps: NDArray[np.int64]  # the distinct steps, ascending
    units: rollups.Units | None  # one unit per step; None when there are no events
    counts: NDArray[np.int64]  # the events of each step


def decode_steps(events: list[StoredEvent]) -> StepUnits:
    """``decode`` the events and make their units one per step (``units_from_run``)."""
    run = decode(events)
    steps = np.unique(run.event_step)
    if not len(steps):
        return StepUnits(run, steps, None, np.zeros(0, np.int64))
    world_size = int(run.event_world_size.max())
    units = units_from_run(run, steps, np.arange(len(steps)), len(steps), world_size)
    counts = np.bincount(np.searchsorted(steps, run.event_step), minlength=len(steps))
    return StepUnits(run, steps, units, counts)
