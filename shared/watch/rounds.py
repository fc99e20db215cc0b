"""The watch (contract 7): every live run's findings, kept without anyone looking, and alerts.

A round, run by the watch function on a schedule (EventBridge on AWS, a background process in
``instantml local``), takes each run with activity in the last ``WATCH_SPAN_S`` and:

1. when events arrived, summarizes its last ``WINDOW_STEPS`` steps (at most every ``SUMMARY_EVERY_S``)
   (``shared.summary.document``: rollups for all but the newest steps, so a round costs the same at step
   100,000 as at step 3,000; a finished run as a whole) and reads the tail's event times to learn its pace;
2. adds the wall-clock findings (``shared.findings.clock``) from that pace and the server's clock;
3. decides, with ``decide`` (a pure function of the alerts still open and the new findings), which
   alerts open and which resolve;
4. keeps the findings, their counts and the open alerts in the run record, and hands each alert to the
   project's webhooks whose ``min_severity`` it reaches (an outbox: retried, never lost).

Only ``watch_run`` and ``watch_round`` touch the store; the rest is pure.
"""

from __future__ import annotations

import hashlib
import json
import math
import time as clock
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any, Literal

import numpy as np

from instantml import routes
from shared import rollups
from shared.findings import Finding, is_time_key, name_hosts, worst_first
from shared.findings.clock import Pace, clock_findings, pace_of, settled_step, silent_after
from shared.findings.processes import explained, process_findings
from shared.processes.records import documents, strip_counts, with_states
from shared.runs import findings_text
from shared.severity import Severity, severity_counts, severity_rank
from shared.store.port import Delivery, EventStore, RunRecord, WatchStore, Webhook
from shared.summary.query import parse_query
from shared.summary.reads import distributed_summary

#: A live run is summarized again at most this often (its clock findings are judged every round).
SUMMARY_EVERY_S = 30.0
#: Runs with events received within this span are watched (contract 7 says 10 minutes; an hour lets a
#: run whose longest pause is long still be found stalled, and costs little: no new events, no summary).
WATCH_SPAN_S = 3600.0
#: Steps of the tail whose event times give the run's pace (merged with what earlier rounds learned).
TAIL_STEPS = 32
#: Events of the tail read at most (512 ranks x 32 steps fit).
TAIL_EVENTS = 20_000
#: A live run is judged over its last steps only, from the start of a block (rollups for all but the
#: newest steps, so a round reads as much at step 100,000 as at step 3,000); a finished run as a whole.
WINDOW_STEPS = 2_000
#: A live run's window starts on a block of this many steps (a level of rollups), so that it is read from
#: whole blocks rather than their parts.
WINDOW_ALIGN = rollups.LEVELS[2]
#: A finding absent this many rounds in a row is resolved (a boundary case must not open and resolve
#: at every round).
RESOLVE_ROUNDS = 2
#: Findings kept in the run record (the worst first); the counts cover them all.
KEPT_FINDINGS = 50
#: Kinds that describe the summary, not the job.
NOT_ALERTS = frozenset({"partial"})

AlertState = Literal["opened", "resolved"]


def identity(finding: Finding) -> str:
    """What makes two findings one alert: the same kind, rank and key (contract 7)."""
    return f"{finding['kind']}|{finding.get('rank')}|{finding.get('key')}"


@dataclass
class OpenAlert:
    finding: Finding
    severity: Severity  # the highest severity announced for this onset
    opened_at: float
    absent: int = 0  # rounds in a row without the finding


@dataclass(frozen=True)
class Transition:
    """An alert's change of state: ``opened`` from ``before`` (None: new) to ``after``, or ``resolved``."""

    state: AlertState
    finding: Finding
    before: Severity | None
    after: Severity | None
    onset: float  # when the onset was first seen: with the identity, names the onset


def decide(
    open_alerts: dict[str, OpenAlert], findings: list[Finding], now: float
) -> tuple[list[Transition], dict[str, OpenAlert]]:
    """The alerts that open, rise or resolve when ``findings`` replace the last round's.

    Pure: the same inputs give the same answer, and nothing is sent from here. A finding seen for the
    first time opens; one seen again at a higher severity rises (webhooks whose ``min_severity`` it now
    reaches hear of it once); one missing ``RESOLVE_ROUNDS`` rounds in a row resolves.
    """
    transitions: list[Transition] = []
    after: dict[str, OpenAlert] = {}
    seen: set[str] = set()
    for finding in findings:
        if finding["kind"] in NOT_ALERTS:
            continue
        key = identity(finding)
        if key in seen:
            continue
        seen.add(key)
        old = open_alerts.get(key)
        severity = finding["severity"]
        if old is None:
            after[key] = OpenAlert(finding, severity, now)
            transitions.append(Transition("opened", finding, None, severity, now))
        elif severity_rank(severity) > severity_rank(old.severity):
            after[key] = OpenAlert(finding, severity, old.opened_at)
            transitions.append(Transition("opened", finding, old.severity, severity, old.opened_at))
        else:
            after[key] = OpenAlert(finding, old.severity, old.opened_at)
    for key, old in open_alerts.items():
        if key in seen:
            continue
        if old.absent + 1 >= RESOLVE_ROUNDS:
            transitions.append(Transition("resolved", old.finding, old.severity, None, old.opened_at))
        else:
            after[key] = OpenAlert(old.finding, old.severity, old.opened_at, old.absent + 1)
    return transitions, after


def reaches(transition: Transition, min_severity: Severity) -> bool:
    """Whether a webhook with ``min_severity`` hears of ``transition``: an onset once, when it first
    reaches that severity; its end only when the onset was announced to it."""
    bar = severity_rank(min_severity)
    if transition.state == "opened":
        before = -1 if transition.before is None else severity_rank(transition.before)
        return before < bar <= severity_rank(transition.after or "info")
    return severity_rank(transition.before or "info") >= bar


# ---------------------------------------------------------------- the run record's words


def counts(findings: list[Finding]) -> dict[Severity, int]:
    """Findings by severity (contract 3.3: ``findings`` of ``GET .../runs``)."""
    return severity_counts(f["severity"] for f in findings if f["kind"] not in NOT_ALERTS)


_WORDS = {
    "stopped_reporting": "stopped",
    "missing_steps": "misses steps",
    "noisy_rank": "noisy",
    "spike": "spikes",
    "nonfinite": "NaN/Inf",
    "rank_disagreement": "out of sync",
    "weighted_differs": "weights skew the mean",
    "straggler": "straggles",
    "memory_growth": "memory keeps growing",
    "memory_high": "holds far more memory",
    "gpu_idle": "GPU idle",
}


#: Kinds whose headline says the key: "rank 3 memory keeps growing on system/rss_mb".
_ON_KEY = ("spike", "nonfinite", "noisy_rank", "rank_disagreement", "memory_growth", "memory_high")


def headline(finding: Finding) -> str:
    """A finding in a few words, for a runs page row: "rank 5 stopped", "stalled 4 min"."""
    kind, rank, key = finding["kind"], finding.get("rank"), finding.get("key")
    if kind == "stalled":
        return f"stalled: {finding.get('short', 'no rank reporting')}"
    if "short" in finding:  # the process rows say themselves in a few words
        return finding["short"]
    if kind == "persistent_outlier":
        word = "high" if "above" in finding["message"] or "x its peers" in finding["message"] else "low"
        word = "slow" if word == "high" and key and is_time_key(key) else word
        what = f"{word} on {key}"
    elif kind == "node_outlier":
        return f"node of rank {rank}: {finding['message'].split(':', 1)[0][:60]}"
    else:
        what = _WORDS.get(kind, kind.replace("_", " "))
        if key and kind in (
            "spike",
            "nonfinite",
            "noisy_rank",
            "rank_disagreement",
            "memory_growth",
            "memory_high",
        ):
            what = f"{what} on {key}"
    return what if rank is None else f"rank {rank} {what}"


# ---------------------------------------------------------------- alerts: what a webhook receives


def alert_payload(transition: Transition, project: str, run_id: str, base_url: str | None) -> dict[str, Any]:
    """Contract 7: the JSON an alert POSTs (``text`` reads as a Slack or Mattermost message)."""
    finding = transition.finding
    tab = routes.DISTRIBUTED_VIEW.format(project=project, run_id=run_id)
    url = f"{base_url.rstrip('/')}{tab}" if base_url else tab
    if transition.state == "opened":
        text = f"{finding['severity'].upper()} {project}/{run_id}: {finding['message']}"
    else:
        text = f"RESOLVED {project}/{run_id}: no longer seen: {finding['message']}"
    return {
        "text": f"{text} ({url})",
        "state": transition.state,
        "project": project,
        "run_id": run_id,
        "finding": finding,
        "url": url,
    }


def deliveries(
    transitions: list[Transition],
    webhooks: list[Webhook],
    project: str,
    run_id: str,
    base_url: str | None,
) -> list[Delivery]:
    """One delivery per transition and webhook that hears of it; ids are stable for one onset, so a
    round repeated after a crash names the same deliveries."""
    out: list[Delivery] = []
    for transition in transitions:
        payload = alert_payload(transition, project, run_id, base_url)
        for hook in webhooks:
            if not reaches(transition, hook.min_severity):
                continue
            name = "|".join(
                (
                    project,
                    run_id,
                    identity(transition.finding),
                    repr(transition.onset),
                    transition.state,
                    transition.after or "",
                    hook.url,
                )
            )
            delivery_id = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
            out.append(Delivery(delivery_id, project, hook.url, payload))
    return out


# ---------------------------------------------------------------- the state kept per run


@dataclass
class WatchState:
    """What the watch keeps in a run's record between rounds."""

    findings: list[Finding] = field(default_factory=list)  # the last round's, worst first, capped
    summary_findings: list[Finding] = field(default_factory=list)  # of the last summary (no clock rules)
    counts: dict[Severity, int] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # the strip's states (``strip_counts``)
    open: dict[str, OpenAlert] = field(default_factory=dict)
    pace: Pace = field(default_factory=Pace)
    received: float = 0.0  # the record's ``received`` when the run was last summarized
    cut: int | None = None  # the last step that summary judged (``settled_step``), None for all
    summarized_at: float = 0.0  # when (the round's clock)
    paced: float = 0.0  # the record's ``received`` when the pace was last read
    watched_at: float = 0.0

    def to_json(self) -> str:
        document = asdict(self)
        return json.dumps(document, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | None) -> WatchState:
        if not text:
            return cls()
        document = json.loads(text)
        return cls(
            findings=document.get("findings", []),
            summary_findings=document.get("summary_findings", []),
            counts=document.get("counts", {}),
            processes=document.get("processes", {}),
            open={k: OpenAlert(**v) for k, v in document.get("open", {}).items()},
            pace=Pace(**document.get("pace", {})),
            received=document.get("received", 0.0),
            cut=document.get("cut"),
            summarized_at=document.get("summarized_at", 0.0),
            paced=document.get("paced", 0.0),
            watched_at=document.get("watched_at", 0.0),
        )


@dataclass
class RoundReport:
    runs: int = 0
    summarized: int = 0
    transitions: list[tuple[str, str, Transition]] = field(default_factory=list)  # (project, run, ...)
    deliveries: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def tail_pace(store: EventStore, project: str, run_id: str, last_step: int | None, before: Pace) -> Pace:
    """The run's pace from its tail's event times (and what earlier rounds learned)."""
    if last_step is None:
        return before
    page = store.read_events(project, run_id, max(0, last_step - TAIL_STEPS), None, TAIL_EVENTS)
    events = page.events
    if not events:
        return before
    n = len(events)
    steps = np.fromiter(map(attrgetter("step"), events), np.int64, n)
    ranks = np.fromiter(map(attrgetter("rank"), events), np.int64, n)
    sizes = np.fromiter(map(attrgetter("world_size"), events), np.int64, n)
    # Each event's values are packed as float64 [weight, time, ...]: one join, one frombuffer.
    times = np.frombuffer(b"".join([e.packed[8:16] for e in events]), "<f8")
    return pace_of(steps, ranks, times, sizes, before)


def watch_run(
    store: WatchStore,
    project: str,
    record: RunRecord,
    webhooks: list[Webhook],
    now: float,
    base_url: str | None,
    state: WatchState | None = None,
    may_summarize: bool = True,
) -> tuple[WatchState, list[Transition], list[Delivery]]:
    """One run's round: findings (recomputed when events arrived and ``may_summarize``), decisions,
    and what to send."""
    state = WatchState.from_json(record.watch) if state is None else state
    received = record.received or record.last_event
    finished = record.finished is not None
    if received > state.paced or not state.watched_at:
        state.pace = tail_pace(store, project, record.run_id, record.last_step, state.pace)
        state.paced = received
    cut = settled_step(state.pace, record.last_step, received, now)
    changed = received > state.received or cut != state.cut or not state.watched_at
    # A live run's summary is the costly part of a round: at most one per SUMMARY_EVERY_S, and only
    # within the round's budget (the clock's findings, a stopped rank's among them, are judged every
    # round). A run's first look, and the one that judges it whole once its events have stopped, are
    # never put off.
    periodic = may_summarize and now - state.summarized_at >= SUMMARY_EVERY_S
    stopped = now - received > silent_after(state.pace)  # its events have stopped arriving
    final = stopped and cut is None and (received > state.received or state.cut is not None)
    if changed and (periodic or final or not state.watched_at):
        summary = None
        if cut is None or cut >= 0:
            query = parse_query(window(record.last_step, finished, cut))
            summary = distributed_summary(store, project, record.run_id, query, arrays=True)
        state.summary_findings = [] if summary is None else list(summary["findings"])
        state.received, state.cut, state.summarized_at = received, cut, now
    clock_rows = clock_findings(state.pace, record.last_step, finished, received, now)
    # What the processes say of themselves (contract 8): who went first and how; it explains the
    # clock's and the summary's rows about silence, which are then dropped (one failure, one alert).
    last_events = dict(zip(state.pace.ranks, state.pace.last_time, strict=True))
    docs = documents(store.processes(project, record.run_id))
    process_rows = process_findings(docs, last_events, state.pace.interval, now)
    findings = name_hosts(explained(merge(state.summary_findings, clock_rows + process_rows)), record.hosts)
    transitions, state.open = decide(state.open, findings, now)
    ordered = worst_first([f for f in findings if f["kind"] not in NOT_ALERTS])
    state.findings = ordered[:KEPT_FINDINGS]
    state.counts = counts(findings)
    rows = [{**doc, "state": state} for doc, state in with_states(docs, now, last_events)]
    state.processes = strip_counts(rows, findings)
    state.watched_at = now
    return state, transitions, deliveries(transitions, webhooks, project, record.run_id, base_url)


def window(last_step: int | None, finished: bool, cut: int | None) -> dict[str, str]:
    """The summary query of a round: the last ``WINDOW_STEPS`` of a live run (from a block's first step),
    up to ``cut``; all of a finished one."""
    query: dict[str, str] = {}
    if not finished and last_step is not None and last_step > WINDOW_STEPS:
        low = last_step - WINDOW_STEPS
        query["step_min"] = str(low - low % WINDOW_ALIGN)
    if cut is not None:
        query["step_max"] = str(cut)
    return query


def merge(summary: list[Finding], clock_rows: list[Finding]) -> list[Finding]:
    """The summary's findings and the clock's, one row per identity (the more severe kept)."""
    rows: dict[str, Finding] = {}
    for finding in [*summary, *clock_rows]:
        key = identity(finding)
        old = rows.get(key)
        if old is None or severity_rank(finding["severity"]) > severity_rank(old["severity"]):
            rows[key] = finding
    return list(rows.values())


def watch_round(
    store: WatchStore,
    now: float | None = None,
    base_url: str | None = None,
    limit: int = 10_000,
    summary_budget_s: float = math.inf,
    only: set[tuple[str, str]] | None = None,
) -> RoundReport:
    """Watch every run with events received in the last ``WATCH_SPAN_S`` (``only``: those of these
    (project, run id) pairs, a nudge's). A run that fails is reported and left for the next round; the
    others go on.

    Summaries (the costly part) are made while the round is under ``summary_budget_s``, the runs summarized
    longest ago first; the others wait for a later round, and every run's clock findings are judged in
    every round. So a round stays bounded however many runs are live, and no run waits for ever."""
    started = clock.perf_counter()
    now = clock.time() if now is None else now
    report = RoundReport()
    hooks: dict[str, list[Webhook]] = {}
    watched = [
        (project, record, WatchState.from_json(record.watch))
        for project, record in store.watched_runs(now - WATCH_SPAN_S, limit)
        if only is None or (project, record.run_id) in only
    ]
    watched.sort(key=lambda item: item[2].summarized_at)
    for project, record, state in watched:
        report.runs += 1
        # A finished run is looked at until a round has judged all of it after its last event.
        done = (
            record.finished is not None
            and state.watched_at >= max(record.finished, record.received or 0.0)
            and state.cut is None
        )
        if done and not state.open:
            continue
        try:
            if project not in hooks:
                hooks[project] = store.get_webhooks(project)
            before = state.summarized_at
            in_budget = clock.perf_counter() - started < summary_budget_s
            state, transitions, sends = watch_run(
                store, project, record, hooks[project], now, base_url, state, in_budget
            )
            report.summarized += state.summarized_at != before
            top = state.findings[0] if state.findings else None
            words = headline(top) if top and top["severity"] != "info" else None
            store.save_watch(
                project,
                record.run_id,
                state.to_json(),
                findings_text(state.counts, state.processes),
                words,
                now,
                sends,
            )
            report.transitions += [(project, record.run_id, t) for t in transitions]
            report.deliveries += len(sends)
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the others' watch
            report.failed.append(f"{project}/{record.run_id}: {type(exc).__name__}: {exc}")
    report.seconds = clock.perf_counter() - started
    return report


def round_json(report: RoundReport) -> dict[str, Any]:
    """What a round did, in numbers (the scheduled function's answer and log line)."""
    return {
        "runs": report.runs,
        "summarized": report.summarized,
        "transitions": len(report.transitions),
        "deliveries": report.deliveries,
        "failed": len(report.failed),
        "seconds": round(report.seconds, 3),
    }
