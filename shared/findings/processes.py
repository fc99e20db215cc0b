"""What the processes say of themselves (contract 8): who went first, and how. No I/O.

Input: the documents of a run's processes (``shared.processes.records``), each rank's last event time as
the watch knows it (``Pace``), the run's step interval, and the server's clock.

- ``rank_exited`` (critical): a process ended by an exception, a signal or a non-zero exit code. The
  first to end is the culprit; the ends that followed it are its consequences and only counted in its
  message: a launcher's signal (torchrun and SLURM end the others with SIGTERM) and a collective's error
  (a peer closed the connection, a collective timed out: ``CONSEQUENCE``) are never a culprit while some
  other failure explains them. When every rank was ended by one signal at once and nothing failed
  first, the job was stopped from outside (preemption, ``scancel``, Ctrl-C): one row without a rank,
  ``warning`` (``info`` for SIGINT).
- ``rank_vanished`` (critical): a process with no ``ended`` record whose last sign of life (its last
  event or record) is ``GRACE_S`` older than the first end of a peer, or older than ``vanish_after`` while
  its peers still show life: SIGKILL, the OOM killer, a lost node. In spool mode the uploader outlives
  it and says so at once: an ``ended`` record with ``how: vanished``, dated at its last write.
- ``rank_stuck`` (warning; critical after ``STUCK_CRITICAL_S``): no culprit, and processes that are alive
  but silent (their beats carry the main thread's stack): the rank or small group whose stack differs
  from the rest is named, with where it is and where the others wait; when every rank waits at the same
  place (or no rank sets itself apart), one ``info`` row without a rank says where: a pause every rank
  shares is not a warning, and ``stalled`` (section 7) says when the whole job has been quiet too long.
  Ranks that have not beaten yet are waited for, and a silent rank is stuck on its own only while
  others log during its silence.
- ``restarted`` and ``world_size_changed`` (info): a rank's document keeps the processes before its
  current one (``prior``): the job restarted, from which step, and whether the world changed.

``explained`` then drops what these rows explain: ``stalled``, ``stopped_reporting``, ``missing_steps``
and the ``node_outlier`` rows made of them, so that one failure is one alert naming its culprit.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from shared.findings.clock import duration
from shared.findings.common import Finding, _finding
from shared.processes.records import state_of
from shared.severity import Severity

#: Records of a launcher's teardown (a survivor's ``ended``, flushed within a few seconds) land within
#: this long: a process without one is judged only after it.
GRACE_S = 15.0
#: A process silent past max(this, 5 step intervals + 2 beats + ``GRACE_S``) while its peers show life
#: has vanished: an alive process logs, or beats every 30 s.
VANISH_MIN_S = 90.0
STUCK_CRITICAL_S = 300.0
#: A stopped-from-outside job: this share of its ranks ended by one signal within ``TOGETHER_S``.
TOGETHER_SHARE, TOGETHER_S = 0.5, 5.0
#: The messages of errors a collective raises when a peer is gone: consequences, never a culprit.
CONSEQUENCE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|timeout|watchdog|"
    r"socket|peer|gloo|nccl|processgroup|collective",
    re.IGNORECASE,
)
#: The kinds these rows explain (dropped beside a culprit or a hang).
EXPLAINED = ("stalled", "stopped_reporting", "missing_steps")
PROCESS_KINDS = ("rank_exited", "rank_vanished", "rank_stuck", "restarted", "world_size_changed")


def process_findings(
    docs: list[dict[str, Any]],
    last_events: Mapping[int, float],
    interval: float | None,
    now: float,
) -> list[Finding]:
    """The process rows of a run (see the module's docstring)."""
    if not docs:
        return []
    attempt = max(d.get("attempt") or 0 for d in docs)
    current = [d for d in docs if (d.get("attempt") or 0) == attempt and d.get("started") is not None]
    rows = _restarts(current)
    failures = _failures(current, last_events, interval, now)
    if failures:
        culprit = _culprit(failures, current, now)
        rows += [culprit] if culprit is not None else []
    else:
        rows += _stuck(current, last_events, now)
    return rows


def explained(findings: list[Finding]) -> list[Finding]:
    """``findings`` without the rows a culprit or a hang explains (a row at ``warning`` or above: an
    ``info`` row of a shared pause leaves ``stalled`` to say whether it lasts too long)."""
    if not any(
        f["kind"] in ("rank_exited", "rank_vanished", "rank_stuck") and f["severity"] != "info"
        for f in findings
    ):
        return findings
    return [
        f
        for f in findings
        if f["kind"] not in EXPLAINED and not (f["kind"] == "node_outlier" and f.get("of") in EXPLAINED)
    ]


def _alive(doc: dict[str, Any], last_events: Mapping[int, float]) -> float:
    return max(float(doc.get("seen") or 0.0), float(last_events.get(doc["rank"], 0.0)))


def _consequence(doc: dict[str, Any]) -> bool:
    """An end that follows another's: a launcher's signal, or a collective's error."""
    how = doc.get("how")
    if how == "signal":
        return True
    if how == "exception":
        exception = doc.get("exception") or {}
        return bool(CONSEQUENCE.search(f"{exception.get('type', '')}: {exception.get('message', '')}"))
    return False


def _failed(doc: dict[str, Any]) -> bool:
    how = doc.get("how")
    return how in ("exception", "signal", "vanished") or (how == "exit" and doc.get("code") not in (0, None))


def _failures(
    current: list[dict[str, Any]], last_events: Mapping[int, float], interval: float | None, now: float
) -> list[tuple[float, str, dict[str, Any]]]:
    """(when, ``exited`` or ``vanished``, document) of each process that failed, earliest first."""
    failures = [
        (float(d["ended"]), "vanished" if d.get("how") == "vanished" else "exited", d)
        for d in current
        if d.get("ended") is not None and _failed(d)
    ]
    ends = [float(d["ended"]) for d in current if d.get("ended") is not None and d.get("how") != "finished"]
    first_end = min(ends, default=None)
    vanish_after = max(VANISH_MIN_S, 5.0 * (interval or 0.0) + 60.0 + GRACE_S)
    open_docs = [d for d in current if d.get("ended") is None]
    freshest = max((_alive(d, last_events) for d in open_docs), default=0.0)
    for doc in open_docs:
        alive = _alive(doc, last_events)
        quiet = now - alive
        after_an_end = first_end is not None and now - first_end >= GRACE_S and quiet >= GRACE_S
        while_peers_live = quiet > vanish_after and now - freshest < vanish_after / 2
        if after_an_end or while_peers_live:
            failures.append((alive, "vanished", doc))
    return sorted(failures, key=lambda f: f[0])


def _culprit(
    failures: list[tuple[float, str, dict[str, Any]]], current: list[dict[str, Any]], now: float
) -> Finding | None:
    """The failure that came first, with the others counted; None while only consequences are known
    and the records (or the silence) that may name their cause can still arrive."""
    primary = [f for f in failures if f[1] == "vanished" or not _consequence(f[2])]
    if primary:
        at, what, doc = primary[0]
        exited = [f for f in primary if f[1] == "exited"]
        # A vanished process died some time after its last sign of life: an end recorded soon after that
        # is the better culprit (the vanished one may have been killed in the teardown that followed).
        if what == "vanished" and exited and exited[0][0] - at < GRACE_S:
            at, what, doc = exited[0]
    else:
        at, what, doc = failures[0]
        if now - at < GRACE_S:
            return None
        together = [
            f for f in failures if f[2].get("signal") == doc.get("signal") and f[0] - at <= TOGETHER_S
        ]
        if doc.get("how") == "signal" and len(together) >= max(2, TOGETHER_SHARE * len(current)):
            return _stopped_from_outside(doc, together, current)
    followers = [f for f in failures if f[2] is not doc]
    rank = doc["rank"]
    step = doc.get("step")
    host = f" on host {doc['host']}" if doc.get("host") else ""
    at_step = f" at step {step}" if step is not None else ""
    if what == "vanished":
        kind = "rank_vanished"
        seen = "; its uploader saw it go" if doc.get("how") == "vanished" else ""
        text = (
            f"rank {rank} vanished{at_step}{host}: its process (pid {doc.get('pid')}) stopped without a word "
            f"(SIGKILL, the OOM killer, a lost node){seen}"
        )
    else:
        kind = "rank_exited"
        text = f"rank {rank} {_how(doc)}{at_step}{host}"
    return {
        **_finding(kind, rank, None, step, "critical", text + _followed(followers, at)),
        "short": f"rank {rank} {'vanished' if what == 'vanished' else _short(doc)}",
    }


def _how(doc: dict[str, Any]) -> str:
    how = doc.get("how")
    if how == "exception":
        exception = doc.get("exception") or {}
        where = f" at {exception['where']}" if exception.get("where") else ""
        message = f": {exception['message']}" if exception.get("message") else ""
        return f"raised {exception.get('type', 'an exception')}{message}{where}"
    if how == "signal":
        return f"was ended by {doc.get('signal', 'a signal')}"
    return f"exited with code {doc.get('code')}"


def _short(doc: dict[str, Any]) -> str:
    how = doc.get("how")
    if how == "exception":
        return f"raised {(doc.get('exception') or {}).get('type', 'an exception')}"
    return "ended by " + str(doc.get("signal")) if how == "signal" else f"exited {doc.get('code')}"


def _followed(followers: list[tuple[float, str, dict[str, Any]]], at: float) -> str:
    """What followed the culprit, counted: "; 7 other ranks ended after it within 3 s (6 by SIGTERM, 1
    vanished)"."""
    if not followers:
        return ""
    ways = Counter(
        "vanished"
        if what == "vanished"
        else (_short(doc).removeprefix("ended ") if doc.get("how") else "ended")
        for _, what, doc in followers
    )
    span = max(0.0, max(f[0] for f in followers) - at)
    listed = ", ".join(f"{n} {way}" for way, n in ways.most_common())
    n = len(followers)
    return (
        f"; {n} other rank{'s' if n > 1 else ''} ended after it within {duration(span)} ({listed}): "
        "its consequences, not failures of their own"
    )


def _stopped_from_outside(
    doc: dict[str, Any], together: list[tuple[float, str, dict[str, Any]]], current: list[dict[str, Any]]
) -> Finding:
    name = doc.get("signal")
    severity: Severity = "info" if name == "SIGINT" else "warning"
    span = max(f[0] for f in together) - together[0][0]
    return {
        **_finding(
            "rank_exited",
            None,
            None,
            doc.get("step"),
            severity,
            f"the job was stopped from outside: {len(together)} of its {len(current)} ranks were ended by "
            f"{name} within {duration(span)} and none failed before (a launcher, a scheduler's preemption or "
            "scancel, a Ctrl-C)",
        ),
        "short": f"stopped by {name}",
    }


def _where(stack: list[str]) -> str:
    """A stack's place in words: its innermost frame of the user's code, and the innermost frame."""
    if not stack:
        return "an unknown place (no stack: INSTANTML_STACKS=0?)"
    user = [line for line in stack if not _library(line)]
    inner = stack[-1]
    if user and user[-1] != inner:
        return f"{user[-1]} (innermost: {inner})"
    return inner


def _library(line: str) -> bool:
    return (
        "site-packages" in line or "dist-packages" in line or "/lib/python3" in line or line.startswith("<")
    )


def _stuck(current: list[dict[str, Any]], last_events: Mapping[int, float], now: float) -> list[Finding]:
    live = [d for d in current if d.get("ended") is None]
    silent = [d for d in live if state_of(d, now, last_events.get(d["rank"])) == "silent"]
    if not silent:
        return []

    def silent_for(doc: dict[str, Any]) -> float:
        return float(doc.get("silent_s") or 0.0) + max(0.0, now - float(doc["beat"]))

    longest = max(silent_for(d) for d in silent)
    severity: Severity = "critical" if longest >= STUCK_CRITICAL_S else "warning"
    # A rank still logs when it logged during the shortest silence and never went quiet since the first
    # silence began (a rank back from a pause every rank shared beat in it): the silent ranks are stuck.
    shortest = min(silent_for(d) for d in silent)
    began = min(float(d["beat"]) - float(d.get("silent_s") or 0.0) for d in silent)
    logging = [
        d
        for d in live
        if d not in silent
        and now - last_events.get(d["rank"], 0.0) < shortest / 2
        and float(d.get("beat") or 0.0) < began
    ]
    if len(logging) < len(live) // 2 and len(silent) < len(live) - len(live) // 8:
        return []  # the others are quiet too, and have not said where yet: the next beats will
    if len(logging) >= len(live) // 2:
        return [
            _finding(
                "rank_stuck",
                d["rank"],
                None,
                d.get("step"),
                severity,
                f"rank {d['rank']} has not logged for {duration(silent_for(d))} while its process is alive; "
                f"its main thread is at {_where(d.get('stack') or [])}",
            )
            for d in silent
        ]
    places = Counter(tuple(d.get("stack") or ()) for d in silent)
    ((common, count),) = places.most_common(1)
    others = [d for d in silent if tuple(d.get("stack") or ()) != common]
    step = max((d.get("step") or 0 for d in silent), default=None)
    if not others:  # a pause every rank shares (an evaluation) or a hang: ``stalled`` tells which
        return [
            _finding(
                "rank_stuck",
                None,
                None,
                step,
                "info",
                f"every rank ({len(silent)}) has been silent for {duration(longest)} at the same place: "
                f"{_where(list(common))}: a collective all of them wait in (a peer outside the job, the "
                "network?)",
            )
        ]
    if count * 2 <= len(silent) or len(others) > max(2, len(silent) // 4):  # no rank sets itself apart
        return [
            _finding(
                "rank_stuck",
                None,
                None,
                step,
                "info",
                f"{len(silent)} ranks have been silent for {duration(longest)} at {len(places)} different "
                f"places; the most ({count}) at {_where(list(common))}",
            )
        ]
    named = ", ".join(str(d["rank"]) for d in others)
    first = others[0]
    return [
        {
            **_finding(
                "rank_stuck",
                first["rank"],
                None,
                first.get("step"),
                severity,
                f"rank{'s' if len(others) > 1 else ''} {named} {'is' if len(others) == 1 else 'are'} "
                f"stuck at {_where(first.get('stack') or [])} for {duration(silent_for(first))}, "
                f"while the other {count} wait at {_where(list(common))}: the others wait for "
                f"{'it' if len(others) == 1 else 'them'}",
            ),
            "short": f"rank {first['rank']} stuck",
        }
    ]


def _restarts(current: list[dict[str, Any]]) -> list[Finding]:
    restarted = [d for d in current if d.get("prior")]
    if not restarted:
        return []
    before = [p for d in restarted for p in d["prior"][-1:]]
    reached = max((p.get("step") or 0 for p in before), default=0)
    first = min((d.get("first_step") or 0 for d in restarted), default=0)
    attempt = max(d.get("attempt") or 0 for d in current)
    again = (
        f"; steps {first}-{reached} were logged again (the later values count)" if first <= reached else ""
    )
    rows = [
        _finding(
            "restarted",
            None,
            None,
            first,
            "info",
            f"the job restarted{f' (attempt {attempt})' if attempt else ''} at step {first}: "
            f"{len(restarted)} rank{'s' if len(restarted) > 1 else ''} started again after reaching "
            f"step {reached}{again}",
        )
    ]
    sizes_before = Counter(p.get("world_size") for p in before)
    was = sizes_before.most_common(1)[0][0]
    now_size = max(d.get("world_size") or 0 for d in current)
    if was is not None and was != now_size:
        rows.append(
            _finding(
                "world_size_changed",
                None,
                None,
                first,
                "info",
                f"the world changed from {was} to {now_size} ranks at step {first} (an elastic restart)",
            )
        )
    return rows
