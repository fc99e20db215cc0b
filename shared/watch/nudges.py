"""Telling the watch at once (contract 8): a process's end that may open an alert (an exception, a
signal, a non-zero exit, a writer its uploader saw vanish) is judged by a round for its run right away,
not at the next scheduled round. Pure: how often one function instance nudges a run, and the nudge's
event; the nudge itself (an event on the watch's EventBridge bus, a file the local stack's schedule
reads) is the handler's. Which records nudge is ``shared.processes.records.alarming``."""

from __future__ import annotations

from typing import Any

#: The environment variable that says where a nudge goes: the EventBridge bus whose rule runs the watch
#: (``!Ref WatchNudgeBus``), or ``file:PATH`` (``instantml local``: its schedule reads the file).
NUDGE_ENV = "WATCH_NUDGE"
#: A function instance nudges one run at most this often: the ends of a 512-rank teardown arrive over
#: a few seconds and one round judges them all (a later one judges what came after).
NUDGE_EVERY_S = 5.0
#: Runs an instance remembers having nudged (the oldest are forgotten first).
REMEMBERED_RUNS = 1024


class Throttle:
    """One instance's memory of the runs it nudged: ``due`` says whether to nudge ``run`` now.

    >>> t = Throttle()
    >>> t.due(("p", "r"), 100.0), t.due(("p", "r"), 102.0), t.due(("p", "r"), 105.5)
    (True, False, True)
    """

    def __init__(self, every_s: float = NUDGE_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}

    def due(self, run: tuple[str, str], now: float) -> bool:
        last = self._last.get(run)
        if last is not None and now - last < self.every_s:
            return False
        self._last.pop(run, None)
        self._last[run] = now
        while len(self._last) > REMEMBERED_RUNS:
            del self._last[next(iter(self._last))]
        return True


#: The EventBridge event of a nudge: its source and detail type (the template's ``Nudged`` rule matches
#: them: ``tests/unit/test_template.py``), and its detail, the runs.
SOURCE = "instantml.ingest"
DETAIL_TYPE = "process ended"


def nudge_detail(runs: list[tuple[str, str]]) -> dict[str, Any]:
    """A nudge's detail: a round over these runs only."""
    return {"nudge": [[project, run_id] for project, run_id in runs]}


def nudge_event(runs: list[tuple[str, str]]) -> dict[str, Any]:
    """The watch function's event for a nudge, as EventBridge delivers it (the local stack's too)."""
    return {"source": SOURCE, "detail-type": DETAIL_TYPE, "detail": nudge_detail(runs)}


def nudged_runs(event: dict[str, Any]) -> set[tuple[str, str]] | None:
    """The runs a nudge names (None: a scheduled round, every live run).

    >>> sorted(nudged_runs(nudge_event([("p", "r")])))
    [('p', 'r')]
    >>> nudged_runs({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}}) is None
    True
    """
    detail = event.get("detail") if isinstance(event, dict) and event.get("source") == SOURCE else None
    runs = detail.get("nudge") if isinstance(detail, dict) else None
    if not isinstance(runs, list):
        return None
    return {(str(p), str(r)) for p, r in (pair for pair in runs if isinstance(pair, list) and len(pair) == 2)}
