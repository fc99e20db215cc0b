"""A run update's ``process`` (contract 8): one process record folded into its rank's document."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from shared.processes.records import alarming, fold
from shared.store.port import RunStore

if TYPE_CHECKING:
    from shared.ingest.bodies import ProcessBody


def note_process(
    store: RunStore,
    project: str,
    run_id: str,
    process: ProcessBody,
    at: float,
    nudge: Callable[[str, str], None] | None = None,
) -> None:
    """Fold ``process`` (a checked record) into its rank's document at ``at`` (server-capped time); then
    ``nudge(project, run_id)`` after an end that may open an alert (``records.alarming``), for the watch
    to judge the run at once."""
    note = process.model_dump(exclude_none=True)
    store.update_process(project, run_id, process.rank, partial(_fold, note=note, at=at))
    if nudge is not None and alarming(note):
        nudge(project, run_id)


def _fold(kept: str | None, note: dict[str, object], at: float) -> str | None:
    return fold(kept, note, at)
