"""Units of a summary window and per-block rollups: pure numpy, no I/O.

A summary works on *units*: one distinct step (exact, the default) or one rollup block of
``BLOCK_STEPS`` consecutive step numbers. Per unit it keeps, for each key and rank, the sum of the
finite values, their count, the sum of their weights and the count of NaN/Infinity values, and per rank
how many of the unit's steps it reported and its first and last of them. Columns are groups of
consecutive units, and every reducer of contract 5.2 (each rank averaged over the column, weights
summed) follows from those sums exactly.

A *rolled* block keeps those sums once computed (``shared.rollup_store``), so a long run is summarized
from about 12 KB per key and block instead of 100 events per rank and block. Blocks are rolled up in the
background as events arrive (``shared.rolling``, driven by the table's stream), rolled again when a late
event lands in one, and read from events while they are still being written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

BLOCK_STEPS = 100
_NO_STEP = 255  # in a block header: the rank reported no step of the block (offsets fit a byte)
assert BLOCK_STEPS < _NO_STEP

T = TypeVar("T", bound=np.generic)
Ints = NDArray[np.int64]
Floats = NDArray[np.float64]


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
    rank_first: Ints = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    rank_last: Ints = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    # Units taken from rollups (no single steps known inside them; empty: none) and, for those, per
    # rank the unit's steps before the rank's first and from its first to its last (RolledBlock).
    rolled: NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, bool))
    rank_lead: Ints = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    rank_span: Ints = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    # Per-step detail of the part read from raw events (coverage findings need single steps).
    raw_steps: Ints = field(default_factory=lambda: np.zeros(0, np.int64))
    raw_present: NDArray[np.bool_] = field(default_factory=lambda: np.zeros((0, 0), bool))
    raw_world_size: Ints = field(default_factory=lambda: np.zeros(0, np.int64))
    # Per rank, the first rank of its node (rank - local_rank), -1 where no event said; empty: unknown.
    node_start: Ints = field(default_factory=lambda: np.zeros(0, np.int64))


def group_sum(matrix: NDArray[T], starts: Ints) -> NDArray[T]:
    """Sums of consecutive column groups beginning at ``starts``."""
    if matrix.shape[-1] == 0:
        return matrix
    result: NDArray[T] = np.add.reduceat(matrix, starts, axis=-1)
    return result


def accumulate(rows: Ints, cols: Ints, shape: tuple[int, int], values: Floats | None = None) -> Floats:
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
    n = len(packed) // 24
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
    """What a rolled block holds besides its sums: its steps, world size, events read, and per rank
    below ``world_size`` the steps reported, the first and last of them (-1: none), the block's steps
    before its first and from its first to its last (with those, coverage over rolled blocks counts
    missed steps exactly). ``n_events`` (items read) only grows as events arrive, so a rewrite keeps
    the rollup that saw more (``shared.rollup_store``)."""

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
        """40 bytes, plus 5 bytes a rank when some rank missed a step (offsets within the block)."""
        fixed = struct.pack(
            "<5q", self.first_step, self.last_step, self.n_steps, self.world_size, self.n_events
        )
        if np.all(self.present == self.n_steps):
            return fixed
        base = self.block * BLOCK_STEPS
        first = np.where(self.first >= 0, self.first - base, _NO_STEP)
        last = np.where(self.last >= 0, self.last - base, _NO_STEP)
        per_rank = np.stack([self.present, first, last, self.lead, self.span]).astype(np.uint8)
        return fixed + per_rank.tobytes()


@dataclass(frozen=True)
class RolledBlock:
    """One block's rollup, computed from every event stored in it when it was read."""

    header: BlockHeader
    sums: dict[str, bytes]  # key -> pack_key_units


def unpack_header(block: int, packed: bytes, keys: list[str]) -> BlockHeader:
    first_step, last_step, n_steps, world_size, n_events = struct.unpack_from("<5q", packed)
    ws = world_size
    if len(packed) == 40:  # every rank reported every step
        present = span = np.full(ws, n_steps, np.int64)
        first = np.full(ws, first_step, np.int64)
        last = np.full(ws, last_step, np.int64)
        lead = np.zeros(ws, np.int64)
    else:
        per_rank = np.frombuffer(packed, np.uint8, 5 * ws, 40).reshape(5, ws).astype(np.int64)
        present, lead, span = per_rank[0], per_rank[3], per_rank[4]
        base = block * BLOCK_STEPS
        first = np.where(per_rank[1] == _NO_STEP, -1, per_rank[1] + base)
        last = np.where(per_rank[2] == _NO_STEP, -1, per_rank[2] + base)
    return BlockHeader(
        block, first_step, last_step, n_steps, world_size, n_events, keys, present, first, last, lead, span
    )


def roll_block(block: int, units: Units, n_events: int) -> RolledBlock | None:
    """The rollup of ``block`` from ``units`` holding exactly that block as their one unit."""
    if units.n_steps.shape != (1,) or units.n_steps[0] == 0:
        return None
    ws = int(units.world_size[0])
    sums = {
        key: pack_key_units(k.total[:ws, 0], k.count[:ws, 0], k.weight[:ws, 0], k.nonfinite[:ws, 0])
        for key, k in units.keys.items()
    }
    present = units.present[:ws, 0]
    reported = units.raw_present[:ws]  # ranks x the block's steps
    n = reported.shape[1]
    lead = np.where(present > 0, reported.argmax(axis=1), 0)
    span = np.where(present > 0, n - reported[:, ::-1].argmax(axis=1) - lead, 0)
    header = BlockHeader(
        block,
        int(units.first_step[0]),
        int(units.last_step[0]),
        int(units.n_steps[0]),
        ws,
        n_events,
        list(sums),
        present.copy(),
        units.rank_first[:ws, 0].copy(),
        units.rank_last[:ws, 0].copy(),
        lead.astype(np.int64),
        span.astype(np.int64),
    )
    return RolledBlock(header, sums)
