"""Units of a summary window and per-block rollups: pure numpy, no I/O.

A summary works on *units*: one distinct step (exact, the default) or one rollup block of
``BLOCK_STEPS`` consecutive step numbers. Per unit it keeps, for each key and rank, the sum of the
finite values, their count, the sum of their weights and the count of NaN/Infinity values, and per rank
how many of the unit's steps it reported. Columns are groups of consecutive units, and every reducer of
contract 5.2 (each rank averaged over the column, weights summed) follows from those sums exactly.

A block is *sealed* once every rank below its largest world size has reported every distinct step in
it and the run has moved past it: from then on nothing new arrives for it, so its units are computed
once and kept (``shared.rollup_store``) and a long run is summarized from about 12 KB per key and block
instead of 100 events per rank and block.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

BLOCK_STEPS = 100

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
    # Per-step detail of the part read from raw events (coverage findings need single steps).
    raw_steps: Ints = field(default_factory=lambda: np.zeros(0, np.int64))
    raw_present: NDArray[np.bool_] = field(default_factory=lambda: np.zeros((0, 0), bool))
    raw_world_size: Ints = field(default_factory=lambda: np.zeros(0, np.int64))


def group_sum(matrix: NDArray[T], starts: Ints) -> NDArray[T]:
    """Sums of consecutive column groups beginning at ``starts``."""
    if matrix.shape[-1] == 0:
        return matrix
    result: NDArray[T] = np.add.reduceat(matrix, starts, axis=-1)
    return result


def accumulate(rows: Ints, cols: Ints, shape: tuple[int, int], values: Floats | None = None) -> Floats:
    """``out[rows, cols] += values`` (or += 1) with repeated indices, via one ``bincount``."""
    flat = np.bincount(rows * shape[1] + cols, weights=values, minlength=shape[0] * shape[1])
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
class SealedBlock:
    """A block whose every expected rank reported every step: its sums never change."""

    block: int
    first_step: int
    last_step: int
    n_steps: int
    world_size: int
    keys: dict[str, bytes]  # key -> pack_key_units

    def header(self) -> bytes:
        return struct.pack("<4q", self.first_step, self.last_step, self.n_steps, self.world_size)


def block_of(step: Ints | int) -> Ints | int:
    return step // BLOCK_STEPS


def sealable_blocks(units: Units, block_ids: Ints, run_last_step: int, known: set[int]) -> list[SealedBlock]:
    """The blocks among ``units`` (one unit per block, read whole from raw events) that can be sealed.

    ``block_ids[u]`` is the block of unit ``u`` or -1 when the unit does not hold a whole block.
    A block is sealed when the run has a step after the block's last step number and every rank below
    the block's world size reported all its distinct steps.
    """
    sealed = []
    ranks = np.arange(units.present.shape[0])
    for u, block in enumerate(block_ids.tolist()):
        if block < 0 or block in known or units.n_steps[u] == 0:
            continue
        if run_last_step <= (block + 1) * BLOCK_STEPS - 1:
            continue
        ws = int(units.world_size[u])
        expected = ranks < ws
        if not np.all(units.present[expected, u] == units.n_steps[u]):
            continue
        keys = {
            key: pack_key_units(k.total[:ws, u], k.count[:ws, u], k.weight[:ws, u], k.nonfinite[:ws, u])
            for key, k in units.keys.items()
        }
        sealed.append(
            SealedBlock(
                block,
                int(units.first_step[u]),
                int(units.last_step[u]),
                int(units.n_steps[u]),
                ws,
                keys,
            )
        )
    return sealed
