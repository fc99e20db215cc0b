"""A process's document: what the store keeps per (run, rank), folded from its records. Pure.

One document per rank, overwritten: its current process (pid, attempt, host, world size, first step,
started), its liveness (``seen``: its last record; ``beat``: its last beat, with the main thread's
stack while it is silent), and its end (``ended``, ``how`` and what it says). When another process
takes the rank (a restart: a new attempt, or the same attempt with another pid), the one before is
kept in a few words in ``prior`` (at most ``KEPT_PRIOR``), which is what ``restarted`` and
``world_size_changed`` read. So a document never grows with the run's length: about 1 KB, 5 with a stack.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

#: Earlier processes of a rank kept in its document.
KEPT_PRIOR = 4
#: What a ``started`` record sets, and what a new process clears.
IDENTITY = ("pid", "attempt", "world_size", "local_rank", "host", "first_step")
END = ("how", "exception", "signal", "code")


def fold(kept_text: str | None, note: dict[str, Any], at: float) -> str | None:
    """``kept_text`` (the stored document, JSON) with one record ``note`` (a checked ``process`` body)
    folded in at ``at`` (the record's time, capped at the server's clock); None: nothing changes (a
    record of a process the rank has left behind, or a repeat)."""
    kept: dict[str, Any] | None = json.loads(kept_text) if kept_text else None
    state = note["state"]
    if kept is not None and _older(kept, note, at):
        return None
    if kept is None or (state == "started" and _is_new(kept, note)):
        prior = [] if kept is None else [*kept.get("prior", []), _gist(kept)][-KEPT_PRIOR:]
        kept = {"rank": note["rank"], "started": None, "prior": prior}
        kept.update({k: note.get(k) for k in IDENTITY})
    changed = {"started": _started, "beat": _beat, "ended": _ended}[state](kept, note, at)
    if not changed:
        return None
    kept["seen"] = max(kept.get("seen") or 0.0, at)
    if note.get("step") is not None:
        kept["step"] = max(kept.get("step") or 0, note["step"])
    return json.dumps(kept, separators=(",", ":"), ensure_ascii=False)


def _started(kept: dict[str, Any], note: dict[str, Any], at: float) -> bool:
    if kept.get("started") is not None and kept.get("pid") == note.get("pid"):
        return False  # a replay
    kept.update({k: note.get(k) for k in IDENTITY}, started=at)
    return True


def _beat(kept: dict[str, Any], note: dict[str, Any], at: float) -> bool:
    if kept.get("ended") is not None or (kept.get("beat") is not None and at < kept["beat"]):
        return False
    kept.update(beat=at, every=note.get("every"), silent_s=note.get("silent_s"), stack=note.get("stack"))
    if note.get("thread_failure") is not None:
        kept["thread_failure"] = note["thread_failure"]
    return True


def _ended(kept: dict[str, Any], note: dict[str, Any], at: float) -> bool:
    if kept.get("ended") is not None:
        return False  # the first end counts
    kept["ended"] = at
    kept.update({k: note[k] for k in END if note.get(k) is not None})
    kept.pop("stack", None)
    return True


def _older(kept: dict[str, Any], note: dict[str, Any], at: float) -> bool:
    """A record of an earlier process of this rank: an earlier attempt, or another pid of the same
    attempt that started before the kept one (a restart whose old records arrive late)."""
    if note.get("attempt", 0) != kept.get("attempt", 0):
        return bool(note.get("attempt", 0) < kept.get("attempt", 0))
    if note.get("pid") == kept.get("pid"):
        return False
    started = kept.get("started")
    return started is not None and at < started


def _is_new(kept: dict[str, Any], note: dict[str, Any]) -> bool:
    return note.get("attempt", 0) > kept.get("attempt", 0) or note.get("pid") != kept.get("pid")


def _gist(doc: dict[str, Any]) -> dict[str, Any]:
    """An earlier process in a few words: enough to say that the rank restarted, from where, in which
    world."""
    return {
        k: doc.get(k)
        for k in ("pid", "attempt", "world_size", "first_step", "step", "started", "ended", "how", "signal")
    }


def alarming(note: dict[str, Any]) -> bool:
    """Whether a process record may open an alert at once (contract 8: the watch is nudged for it): an
    end that is not a finish (an exception, a signal, a non-zero exit, a writer gone without a word)."""
    if note.get("state") != "ended":
        return False
    how = note.get("how")
    return how != "finished" and not (how == "exit" and note.get("code") in (0, None))


def documents(texts: dict[int, str]) -> list[dict[str, Any]]:
    """The stored documents of a run's processes, by rank."""
    return [json.loads(texts[rank]) for rank in sorted(texts)]


#: A beat says its process is silent for this many of its beat intervals, and this long besides.
BEAT_HOLDS, BEAT_SLACK_S = 2.0, 15.0


def state_of(doc: dict[str, Any], now: float, last_event: float | None = None, attempt: int = 0) -> str:
    """A process's state as the pages show it: ``ended`` (and how), ``vanished`` (it never ended, and the
    job has started again without it: ``attempt``, the run's newest, is later than its own; an elastic
    restart that lost its node), ``silent`` (its latest beat is recent and came after its last event: its
    main thread has not logged for a while) or ``running``."""
    if doc.get("ended") is not None:
        return "ended"
    if (doc.get("attempt") or 0) < attempt:
        return "vanished"
    beat = doc.get("beat")
    if beat is None or (last_event is not None and beat <= last_event):
        return "running"
    holds = BEAT_HOLDS * float(doc.get("every") or 30.0) + BEAT_SLACK_S
    return "silent" if now - beat <= holds else "running"


def with_states(
    docs: list[dict[str, Any]], now: float, last_events: dict[int, float]
) -> list[tuple[dict[str, Any], str]]:
    """Each document with its state (``state_of``, against the run's newest attempt)."""
    newest = max((doc.get("attempt") or 0 for doc in docs), default=0)
    return [(doc, state_of(doc, now, last_events.get(doc["rank"]), newest)) for doc in docs]


#: The states of the pages' processes strip (contract 8), in the order the runs page draws them.
STRIP_STATES = ("running", "silent", "stuck", "finished", "failed", "signal", "vanished")


def strip_counts(rows: list[dict[str, Any]], findings: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many processes are in each state of the strip (``STRIP_STATES``; the absent ones left out),
    as the tab colours them: what the runs page shows of a run's processes. ``rows``: documents with their
    ``state`` (``state_of``), as ``processes_json`` gives them; ``findings``: the run's, whose
    ``rank_stuck`` and ``rank_vanished`` rows name ranks so."""
    named: dict[str, set[int]] = {"rank_stuck": set(), "rank_vanished": set()}
    for finding in findings:
        if finding.get("kind") in named and isinstance(finding.get("rank"), int):
            named[finding["kind"]].add(finding["rank"])
    found: dict[str, int] = {}
    for row in rows:
        state, how = row.get("state"), row.get("how")
        if state == "ended":
            if how in ("vanished", "signal"):
                word = str(how)
            else:  # (an exit without a code is sys.exit() or the end of the script: a normal exit)
                normal = how == "finished" or (how == "exit" and row.get("code") in (0, None))
                word = "finished" if normal else "failed"
        elif state == "vanished" or row["rank"] in named["rank_vanished"]:
            word = "vanished"
        elif state == "silent":
            word = "stuck" if row["rank"] in named["rank_stuck"] else "silent"
        else:
            word = "running"
        found[word] = found.get(word, 0) + 1
    return {word: found[word] for word in STRIP_STATES if word in found}


#: Frames of a silent process's stack in a summary (the run's record has all of them): 512 stacks stay
#: well inside a response.
SUMMARY_STACK_FRAMES = 6


def processes_json(
    texts: dict[int, str],
    now: float,
    last_events: dict[int, float] | None = None,
    stack_frames: int | None = None,
) -> list[dict[str, Any]]:
    """A run's processes as the API shows them (contract 8): one row per rank, its current process, its
    state, and what it said; a silent one's stack (its innermost ``stack_frames``, if given)."""
    rows = []
    for doc, state in with_states(documents(texts), now, last_events or {}):
        row = {k: v for k, v in doc.items() if v is not None and k != "prior"}
        row["state"] = state
        if row["state"] != "silent":
            row.pop("stack", None)
            row.pop("silent_s", None)
        elif stack_frames is not None and "stack" in row:
            row["stack"] = row["stack"][-stack_frames:]
        row["restarts"] = len(doc.get("prior", []))
        rows.append(row)
    return rows
