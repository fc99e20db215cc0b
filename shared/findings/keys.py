"""One key's findings: the per-key families in order, and what the summary and the cross-key rules
need of them (:class:`KeyResult`). No I/O.

:func:`key_findings` runs ``agreement``'s ``nonfinite``; a key equal on every rank (every column
constant, ``agreement.constant_columns``) stops there; then, for an all-reduced key,
``rank_disagreement`` and ``weighted_differs`` only; else ``peers``' ``persistent_outlier`` and
``noisy_rank`` (from ``MIN_NOISE_RANKS`` ranks), ``spikes``' ``spike`` among the ranks neither
persistently apart nor noisy, and ``weighted_differs``. A system key the client samples stops after
``nonfinite``: ``system``'s rules judge those keys together. It marks the cells behind each ``warning`` or
``critical`` row (the tab's alarms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from shared import stats
from shared.findings.agreement import (
    _all_reduced_agreement,
    _disagreement,
    _nonfinite,
    _weighted,
    constant_columns,
)
from shared.findings.common import Finding, _pers
from shared.findings.peers import MIN_NOISE_RANKS, NOISY_RATIO, Offset, _noisy, _persistent, peer_view
from shared.findings.spikes import _spikes
from shared.findings.system import is_system_key


@dataclass
class KeyResult:
    """The findings about one key, and what the summary and the cross-key rules need of them."""

    findings: list[Finding]
    noise: stats.Vector  # per rank: its own spread over the typical rank's (rank_stats' ``noise``)
    offsets: dict[int, Offset] = field(default_factory=dict)
    relative: bool = False
    #: ranks x columns: the cells that back a ``warning`` or ``critical`` finding (the tab's alarm rows).
    alarm: NDArray[np.bool_] | None = None
    #: ranks below their peers beyond chance, whatever the size (a straggler's shorter wait).
    below: dict[int, Offset] = field(default_factory=dict)


def key_findings(
    key: str,
    values: stats.Matrix,
    weights: stats.Matrix,
    red: stats.Reducers,
    nonfinite: NDArray[np.bool_],
    complete: NDArray[np.bool_],
    columns: NDArray[np.int64],
    bin_size: int,
) -> KeyResult:
    """The findings about one key from its (binned) matrix and its reducers.

    ``nonfinite`` is where a rank reported NaN/Infinity, ``complete`` where a rank reported every step
    of the column with a finite value (only those cells can be compared exactly), ``columns`` the first
    step of each column.
    """
    findings: list[Finding] = []
    pers = _pers(bin_size)
    if nonfinite.any():
        findings += _nonfinite(key, nonfinite, columns, bin_size)
    ranks, n_columns = values.shape
    no_noise = np.full(ranks, np.nan)
    if is_system_key(key):  # a process's own memory and GPU: ``system``'s rules, across its keys
        return KeyResult(findings, no_noise)
    if not findings and n_columns and np.all(constant_columns(red) | (red.count == 0)):
        # Equal on every rank (up to rounding) wherever reported, no NaN: nothing sets a rank apart; what
        # the rules would measure is floating-point noise (a weighted mean "above" by 2e-18).
        return KeyResult(findings, no_noise)
    full = ranks > 0 and (not n_columns or int(red.count.min()) == ranks)  # no value missing
    agreement = _all_reduced_agreement(values, red, complete, full)
    if agreement is not None:
        # An all-reduced key has no spread: deviations only echo the disagreement found here.
        findings += _disagreement(key, values, red.p50, columns, pers, *agreement)
        return KeyResult(findings + _weighted(key, values, weights, red, pers, full), no_noise)
    view = peer_view(values, red.p50)
    if view is None:
        return KeyResult(findings + _weighted(key, values, weights, red, pers, full), no_noise)
    offsets, below, persistent = _persistent(key, view, values, columns, pers)
    findings += persistent
    with np.errstate(invalid="ignore"):  # values near the float range: an infinite typical spread
        noise = view.spread / view.typical if view.typical > 0 else no_noise
    if ranks >= MIN_NOISE_RANKS and view.typical > 0:
        findings += _noisy(key, view, noise, set(offsets), pers)
    quiet = [r for r in range(ranks) if r not in offsets and not (noise[r] >= NOISY_RATIO)]
    spikes, spike_cells = _spikes(key, view, values, columns, bin_size, quiet)
    findings += spikes
    findings += _weighted(key, values, weights, red, pers, full)
    alarm = np.zeros(values.shape, bool)
    for f in findings:
        if f["severity"] != "info" and f["rank"] is not None:
            cells = spike_cells.get(f["rank"]) if f["kind"] == "spike" else None
            alarm[f["rank"], slice(None) if cells is None else cells] = True
    return KeyResult(findings, noise, offsets, view.relative, alarm, below)
