"""Units of a summary window and the levels of rollups: pure numpy, no I/O.

A summary works on *units*: one distinct step, or one block of a level's ``size`` consecutive step
numbers. Per unit it keeps, for each key and rank, the sum of the finite values, their count, the sum of
their weights and the count of NaN/Infinity values, and per rank how many of the unit's steps it
reported and its first and last of them. Columns are groups of consecutive units, and every reducer of
contract 5.2 (each rank averaged over the column, weights summed) follows from those sums exactly.

*Rollups* keep those sums once computed, at the sizes of ``LEVELS`` (1, 10, 100, ... steps: 10x apart,
as Graphite's retentions or Thanos' downsampling are): a level-1 block holds one step's values of every
rank, packed per key (a step read back as a few rows instead of one event per rank), and each coarser
block is :func:`combine` of the ten below it. A summary of any window reads one level's blocks, about as
many as it has columns, whatever the run's length. ``shared.summary.rolling`` keeps the levels as events
arrive.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

#: The steps a block of each level spans.
LEVELS = (1, 10, 100, 1_000, 10_000)
_NO_STEP = 65_535  # in a block header: the rank reported no step of the block (offsets fit 16 bits)
assert LEVELS[-1] < _NO_STEP

Ints = NDArray[np.int64]
Floats = NDArray[np.float64]


def _empty(*shape: int, dtype: type) -> Callable[[], NDArray[Any]]:
    """A default factory of an empty array: numpy's own ``zeros``, bound (no Python frame per instance)."""
    return partial(np.zeros, shape, dtype)


@dataclass
class KeyUnits:
    """One key's sums per rank (rows) and unit (columns)."""

    total: Floats
    count: Ints
    weight: Floats
    nonfinite: Ints


@dataclass
class Units:
    """A window cut into units; every array has one column per unit."""

    first_step: Ints
    last_step: Ints
    n_steps: Ints  # distinct steps in the unit
    world_size: Ints  # the largest world size reported in the unit
    present: Ints  # ranks x units: steps of the unit each rank reported
    keys: dict[str, KeyUnits]
    # ranks x units: each rank's first and last step reported in the unit, -1 for none.
    rank_first: Ints = field(default_factory=_empty(0, 0, dtype=np.int64))
    rank_last: Ints = field(default_factory=_empty(0, 0, dtype=np.int64))
    # Units taken from rollups (no single steps known inside them; empty: none) and, for those, per
    # rank the unit's steps before the rank's first and from its first to its last (RolledBlock).
    rolled: NDArray[np.bool_] = field(default_factory=_empty(0, dtype=bool))
    rank_lead: Ints = field(default_factory=_empty(0, 0, dtype=np.int64))
    rank_span: Ints = field(default_factory=_empty(0, 0, dtype=np.int64))
    # Per-step detail of the part read from raw events (coverage findings need single steps).
    raw_steps: Ints = field(default_factory=_empty(0, dtype=np.int64))
    raw_present: NDArray[np.bool_] = field(default_factory=_empty(0, 0, dtype=bool))
    raw_world_size: Ints = field(default_factory=_empty(0, dtype=np.int64))
    # Per rank, the first rank of its node (rank - local_rank), -1 where no event said; empty: unknown.
    node_start: Ints = field(default_factory=_empty(0, dtype=np.int64))


def merge_nodes(nodes: Ints, seen: Ints) -> Ints:
    """Each rank's node (the first rank of its node) as last said: ``seen`` where known (>= 0), else
    ``nodes``; -1 where neither says."""
    out = np.full(max(len(nodes), len(seen)), -1, np.int64)
    out[: len(nodes)] = nodes
    known = seen >= 0
    out[: len(seen)][known] = seen[known]
    return out


#: Bytes a rank of one key's packed sums: f64 total, f64 weight, u32 count, u32 non-finite count.
KEY_UNIT_BYTES = 24


def pack_key_units(total: Floats, count: Ints, weight: Floats, nonfinite: Ints) -> bytes:
    """One block's sums for one key (vectors over ranks) as bytes: f64 total, f64 weight, u32 counts."""
    return (
        total.astype("<f8").tobytes()
        + weight.astype("<f8").tobytes()
        + count.astype("<u4").tobytes()
        + nonfinite.astype("<u4").tobytes()
    )


def unpack_key_units(packed: bytes, ranks: int) -> tuple[Floats, Ints, Floats, Ints]:
    """The inverse of :func:`pack_key_units`, padded with zeros up to ``ranks`` ranks."""
    n = len(packed) // KEY_UNIT_BYTES
    total = np.zeros(ranks)
    weight = np.zeros(ranks)
    count = np.zeros(ranks, np.int64)
    nonfinite = np.zeros(ranks, np.int64)
    total[:n] = np.frombuffer(packed, "<f8", n, 0)
    weight[:n] = np.frombuffer(packed, "<f8", n, 8 * n)
    count[:n] = np.frombuffer(packed, "<u4", n, 16 * n)
    nonfinite[:n] = np.frombuffer(packed, "<u4", n, 20 * n)
    return total, count, weight, nonfinite


@dataclass(frozen=True)
class BlockHeader:
    """What a rolled block holds besides its sums: its level (``size``, steps a block spans), its steps,
    world size, events read, and per rank below ``world_size`` the steps reported, the first and last of
    them (-1: none), the block's steps before its first and from its first to its last (with those,
    coverage over rolled blocks counts missed steps exactly). ``n_events`` (items read) only grows as
    events arrive, so a rewrite keeps the rollup that saw more."""

    size: int
    block: int
    first_step: int
    last_step: int
    n_steps: int
    world_size: int
    n_events: int
    keys: list[str]
    present: Ints
    first: Ints
    last: Ints
    lead: Ints
    span: Ints

    def packed(self) -> bytes:
        """40 bytes, plus 10 bytes a rank when some rank missed a step (offsets within the block)."""
        fixed = struct.pack(
            "<5q", self.first_step, self.last_step, self.n_steps, self.world_size, self.n_events
        )
        if np.all(self.present == self.n_steps):
            return fixed
        base = self.block * self.size
        first = np.where(self.first >= 0, self.first - base, _NO_STEP)
        last = np.where(self.last >= 0, self.last - base, _NO_STEP)
        per_rank = np.stack([self.present, first, last, self.lead, self.span]).astype("<u2")
        return fixed + per_rank.tobytes()


@dataclass(frozen=True)
class RolledBlock:
    """One block's rollup, computed from every event stored in it when it was read."""

    header: BlockHeader
    sums: dict[str, bytes]  # key -> pack_key_units


def unpack_header(size: int, block: int, packed: bytes, keys: list[str]) -> BlockHeader:
    first_step, last_step, n_steps, world_size, n_events = struct.unpack_from("<5q", packed)
    ws = world_size
    if len(packed) == 40:  # every rank reported every step
        present = span = np.full(ws, n_steps, np.int64)
        first = np.full(ws, first_step, np.int64)
        last = np.full(ws, last_step, np.int64)
        lead = np.zeros(ws, np.int64)
    else:
        per_rank = np.frombuffer(packed, "<u2", 5 * ws, 40).reshape(5, ws).astype(np.int64)
        present, lead, span = per_rank[0], per_rank[3], per_rank[4]
        base = block * size
        first = np.where(per_rank[1] == _NO_STEP, -1, per_rank[1] + base)
        last = np.where(per_rank[2] == _NO_STEP, -1, per_rank[2] + base)
    return BlockHeader(
        size,
        block,
        first_step,
        last_step,
        n_steps,
        world_size,
        n_events,
        keys,
        present,
        first,
        last,
        lead,
        span,
    )


def roll_steps(units: Units, n_events: Ints) -> list[RolledBlock]:
    """Level-1 blocks (one step each) from ``units`` holding one unit per step (``units_from_run`` with
    ``unit_of_step = arange``); ``n_events[i]``: the events read at unit i's step."""
    blocks = []
    for u in range(len(units.n_steps)):
        if units.n_steps[u] == 0:
            continue
        ws = int(units.world_size[u])
        present = units.present[:ws, u].copy()
        reported = present > 0
        step = int(units.first_step[u])
        header = BlockHeader(
            1,
            step,
            step,
            step,
            1,
            ws,
            int(n_events[u]),
            list(units.keys),
            present,
            np.where(reported, step, -1),
            np.where(reported, step, -1),
            np.zeros(ws, np.int64),
            reported.astype(np.int64),
        )
        sums = {
            key: pack_key_units(k.total[:ws, u], k.count[:ws, u], k.weight[:ws, u], k.nonfinite[:ws, u])
            for key, k in units.keys.items()
        }
        blocks.append(RolledBlock(header, sums))
    return blocks


def combine(size: int, block: int, parts: list[RolledBlock]) -> RolledBlock:
    """One block of ``size`` steps from rolled parts inside it (blocks of finer levels; not
    overlapping), exactly as if it had been rolled from their events at once."""
    parts = sorted(parts, key=lambda p: p.header.first_step)
    heads = [p.header for p in parts]
    ws = max(h.world_size for h in heads)

    def per_rank(name: str, fill: int) -> Ints:
        out = np.full((len(heads), ws), fill, np.int64)
        for i, h in enumerate(heads):
            out[i, : h.world_size] = getattr(h, name)
        return out

    present, first, last = per_rank("present", 0), per_rank("first", -1), per_rank("last", -1)
    lead, span = per_rank("lead", 0), per_rank("span", 0)
    n = np.array([h.n_steps for h in heads], np.int64)
    offset = np.concatenate([[0], np.cumsum(n)[:-1]])  # the parts' steps before each part
    has = present > 0
    any_ = has.any(axis=0)
    ranks = np.arange(ws)
    i_first = has.argmax(axis=0)  # each rank's first part with a step, and its last
    i_last = len(heads) - 1 - has[::-1].argmax(axis=0)
    lead_all = offset[i_first] + lead[i_first, ranks]
    end = offset[i_last] + lead[i_last, ranks] + span[i_last, ranks]
    big = np.iinfo(np.int64).max
    header = BlockHeader(
        size,
        block,
        min(h.first_step for h in heads),
        max(h.last_step for h in heads),
        int(n.sum()),
        ws,
        sum(h.n_events for h in heads),
        list(dict.fromkeys(k for h in heads for k in h.keys)),
        present.sum(axis=0),
        np.where(any_, np.where(first >= 0, first, big).min(axis=0), -1),
        last.max(axis=0),
        np.where(any_, lead_all, 0),
        np.where(any_, end - lead_all, 0),
    )
    sums = {}
    for key in header.keys:
        # Sums start at -0.0 and take only parts with values: a rank that logged only -0.0 keeps it.
        total, weight = np.full(ws, -0.0), np.zeros(ws)
        count, nonfinite = np.zeros(ws, np.int64), np.zeros(ws, np.int64)
        for part in parts:
            packed = part.sums.get(key)
            if packed is not None:
                t, c, w, f = unpack_key_units(packed, ws)
                total = np.where(c > 0, total + t, total)
                count += c
                weight += w
                nonfinite += f
        total[count == 0] = 0.0
        sums[key] = pack_key_units(total, count, weight, nonfinite)
    return RolledBlock(header, sums)
