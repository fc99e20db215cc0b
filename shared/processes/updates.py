"""A run update's ``process`` (contract 8): one process record folded into its rank's document."""

from __future__ import annotations

from collections.abc import Callable
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
    changed: list[bool] = []

    def change(kept: str | None) -> str | None:  # (called again if another write raced it)
        folded = fold(kept, note, at)
        changed.append(folded is not None)
        return folded

    store.update_process(project, run_id, process.rank, change)
    # A replay, or a late record of a process the rank has left behind, changes nothing: no nudge.
    if nudge is not None and changed and changed[-1] and alarming(note):
        nudge(project, run_id)
