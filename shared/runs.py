"""A project's runs: their records (kept by the store as events arrive), listing, config and end.

The store keeps one record per run on write (``RunStore``): listing runs never reads their events.
Here the HTTP edge's words meet the store's: the query of ``GET .../runs``, its opaque cursor, the
status a record has now, and the body of ``PATCH .../runs/{run_id}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict, get_args

from instantml import limits
from shared.errors import (
    DomainError,
    FieldError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
)
from shared.ingest.activity import remember
from shared.severity import Severity, severity_counts
from shared.store.port import RunRecord, RunStatus, RunStore

if TYPE_CHECKING:
    from shared.findings import Finding

#: A run that is not finished and has had no event for this long is ``idle``, else ``live``.
IDLE_AFTER_S = 300.0
DEFAULT_LIMIT, MAX_LIMIT = 50, 200
STATUSES: tuple[str, ...] = get_args(RunStatus)
#: A run update is its config and a few fields around it.
MAX_UPDATE_BYTES = limits.MAX_CONFIG_BYTES + 1024


def status(record: RunRecord, now: float) -> RunStatus:
    if record.finished is not None:
        return "finished"
    return "live" if now - record.last_event < IDLE_AFTER_S else "idle"


class WatchView(TypedDict):
    """What the watch keeps of a run, as ``GET .../runs/{run_id}`` shows it."""

    findings: list[Finding]
    watched_at: float | None
    judged_through_step: int | None
    up_to_date: bool
    open_alerts: int


class _RunRow(TypedDict):
    run_id: str
    created: float
    last_event: float
    last_step: int | None
    world_size: int | None
    ranks_reporting: int | None
    status: RunStatus
    finished: float | None
    findings: dict[Severity, int] | None
    findings_at: float | None
    config: dict[str, Any] | None
    headline: str | None
    process_states: dict[str, int] | None


class RunDocument(_RunRow, total=False):  # (total=False: see shared.findings.common.Finding)
    """A run as the API shows it (contract 3.3), its keys in the order written; one run alone has
    ``hosts`` and ``watch`` too."""

    hosts: dict[str, str]
    watch: WatchView | None
    processes: list[dict[str, Any]]


class RunsPage(TypedDict):
    """``GET .../runs``."""

    runs: list[RunDocument]
    next_cursor: str | None
    idle_after_s: float


def run_json(record: RunRecord, now: float, detail: bool = False) -> RunDocument:
    """A record as the API shows it (contract 3.3); ``detail`` adds what the watch keeps of it."""
    counts, states = findings_of(record.findings)
    document: RunDocument = {
        "run_id": record.run_id,
        "created": record.created,
        "last_event": record.last_event,
        "last_step": record.last_step,
        "world_size": record.world_size,
        "ranks_reporting": record.ranks_reporting,
        "status": status(record, now),
        "finished": record.finished,
        "findings": counts,
        "findings_at": record.findings_at,
        "config": None if record.config is None else json.loads(record.config),
        "headline": record.headline,
        "process_states": states,
    }
    if detail:
        # rank -> host, as each process said it at im.init (a rank without a launcher's rank says nothing)
        document["hosts"] = {str(rank): host for rank, host in sorted((record.hosts or {}).items())}
        document["watch"] = watch_json(record)
    return document


def watch_json(record: RunRecord) -> WatchView | None:
    """The watch's view of a run: its findings (worst first, wall-clock ones included), when it looked,
    and whether it had seen every event the server had received by then."""
    if not record.watch:
        return None
    state = json.loads(record.watch)
    seen_all = state.get("received", 0.0) >= (record.received or record.last_event)
    # While a run's uploads arrive, the watch judges it up to the step every rank has reached; a
    # finished run is up to date once it has been judged whole.
    judged_through = state.get("cut")
    return {
        "findings": state.get("findings", []),
        "watched_at": state.get("watched_at"),
        "judged_through_step": judged_through,
        "up_to_date": seen_all and (record.finished is None or judged_through is None),
        "open_alerts": len(state.get("open", {})),
    }


def encode_cursor(record: RunRecord) -> str:
    raw = json.dumps([record.last_event, record.run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        last_event, run_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(last_event, (int, float)) or isinstance(last_event, bool):
            raise ValueError
        if not limits.is_valid_name(run_id) or not math.isfinite(last_event):
            raise ValueError
        return float(last_event), run_id
    except (ValueError, TypeError, OverflowError, binascii.Error):
        message = "is not a cursor this API gave (pass next_cursor of the previous page as it is)"
        raise InvalidInput(f"cursor {message}", [FieldError("cursor", message)]) from None


def list_runs(store: RunStore, project: str, params: dict[str, str], now: float) -> RunsPage:
    """``GET .../runs``: a page of the project's runs, newest activity first."""
    from shared.summary.query import Params  # (with the summary's query: numpy, which the ingest never needs)

    query = Params(params, _LIST_PARAMETERS)
    limit = query.integer("limit", 1, MAX_LIMIT) or DEFAULT_LIMIT
    statuses: frozenset[RunStatus] | None = None
    if params.get("status"):
        asked = [s.strip() for s in params["status"].split(",") if s.strip()]
        unknown = [s for s in asked if s not in STATUSES]
        if unknown or not asked:
            query.errors.append(
                FieldError("status", f"must be one or more of {', '.join(STATUSES)}, got {unknown}")
            )
        statuses = frozenset(asked)  # type: ignore[arg-type]  # checked just above
    query.check()
    after = decode_cursor(params["cursor"]) if params.get("cursor") else None
    records = store.list_runs(project, limit + 1, after, statuses, now - IDLE_AFTER_S)
    more = len(records) > limit
    records = records[:limit]
    return {
        "runs": [run_json(r, now) for r in records],
        "next_cursor": encode_cursor(records[-1]) if more else None,
        "idle_after_s": IDLE_AFTER_S,
    }


_LIST_PARAMETERS = {"limit", "cursor", "status"}


def get_run(store: RunStore, project: str, run_id: str, now: float) -> RunDocument:
    record = store.get_run(project, run_id)
    if record is None:
        raise NotFound(f"project {project!r} has no run {run_id!r}")
    from shared.processes.records import processes_json

    document = run_json(record, now, detail=True)
    document["processes"] = processes_json(store.processes(project, run_id), now)
    return document


def summary_processes(
    store: RunStore, project: str, run_id: str, record: RunRecord | None, now: float
) -> list[dict[str, Any]]:
    """The processes as a summary carries them (contract 8: the tab's strip of rank states), each
    rank's last event as the watch last saw it telling a silent process from one that logs again."""
    from shared.processes.records import SUMMARY_STACK_FRAMES, processes_json

    try:
        texts = store.processes(project, run_id)
    except DomainError:  # the summary is still the answer; the strip comes back with the store
        return []
    if not texts:
        return []
    pace = json.loads(record.watch).get("pace") if record is not None and record.watch else None
    last = dict(zip(pace["ranks"], pace["last_time"], strict=False)) if pace else None
    return processes_json(texts, now, last, stack_frames=SUMMARY_STACK_FRAMES)


def with_run_facts(findings: list[Finding], record: RunRecord | None) -> list[Finding]:
    """A summary's findings with what only the run's record knows: the host of each finding's rank, and
    the watch's rows about the processes (contract 8: who went first, and how), which explain the
    summary's rows about silence (those are then dropped)."""
    from shared.findings import name_hosts
    from shared.findings.processes import PROCESS_KINDS, explained

    if record is None:
        return findings
    watched = watch_json(record)
    rows = [f for f in (watched["findings"] if watched else []) if f["kind"] in PROCESS_KINDS]
    return name_hosts(explained([*rows, *findings]), record.hosts)


def update_run(
    store: RunStore,
    project: str,
    run_id: str,
    raw: bytes,
    now: float,
    nudge: Callable[[str, str], None] | None = None,
) -> RunDocument:
    """``PATCH .../runs/{run_id}``: record the run's config, that it finished, the hosts of some of its
    ranks, and/or a process record (``nudge``: see ``shared.processes.updates.note_process``)."""
    if len(raw) > MAX_UPDATE_BYTES:
        raise PayloadTooLarge(
            f"a run update may be at most {MAX_UPDATE_BYTES} bytes, got {len(raw)}",
            [FieldError("config", f"must be at most {limits.MAX_CONFIG_BYTES} bytes as compact JSON")],
        )
    from shared.ingest.bodies import RunUpdateBody, validate  # (pydantic: at the first update)
    from shared.ingest.json_body import parse_json

    body = validate(RunUpdateBody, parse_json(raw), "run update")
    if body.config is None and body.status is None and body.hosts is None and body.process is None:
        message = (
            "send 'config' (an object), 'status': 'finished', 'hosts' (rank -> host) and/or 'process' "
            "(a process record)"
        )
        raise InvalidInput(f"body: {message}", [FieldError("body", message)])
    config = None
    if body.config is not None:
        config = json.dumps(body.config, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(config.encode())
        if size > limits.MAX_CONFIG_BYTES:
            message = f"must be at most {limits.MAX_CONFIG_BYTES} bytes as compact JSON, got {size}"
            raise PayloadTooLarge(f"config {message}", [FieldError("config", message)])
    time = now if body.time is None else min(body.time, now)
    hosts = None if body.hosts is None else {int(rank): host for rank, host in body.hosts.items()}
    process = body.process
    if process is not None:
        from shared.processes.updates import note_process

        note_process(store, project, run_id, process, time, nudge)
        if process.state == "started" and process.host is not None:  # a finding of its rank names its host
            hosts = {**(hosts or {}), process.rank: process.host}
        elif body.config is None and body.status is None and hosts is None:
            # A beat or an end is not the run's activity (a hung run's beats must not look like progress).
            kept = store.get_run(project, run_id)
            if kept is not None:
                return run_json(kept, now)
    record = store.update_run(project, run_id, time, config, finished=body.status == "finished", hosts=hosts)
    return run_json(record, now)


#: The tab asks for a live run's summary every 5 s: a function instance rewrites unchanged counts at
#: most this often (another instance's newer counts are then at most this old).
FINDINGS_REWRITE_S = 60.0
_noted_findings: weakref.WeakKeyDictionary[RunStore, dict[tuple[str, str], tuple[str, float]]] = (
    weakref.WeakKeyDictionary()
)


def findings_text(counts: dict[Severity, int], processes: dict[str, int] | None) -> str:
    """A record's ``findings`` as stored: the findings by severity and, under ``processes``, the
    processes by the strip's states (``shared.processes.records.strip_counts``). One attribute, which
    the runs index carries already: the runs list reads both from it, ``run_json`` shows them apart."""
    document: dict[str, Any] = {str(severity): n for severity, n in counts.items()}
    if processes:
        document["processes"] = processes
    return json.dumps(document, separators=(",", ":"))


def findings_of(text: str | None) -> tuple[dict[Severity, int] | None, dict[str, int] | None]:
    """``findings_text``'s two parts back (None for a run not judged yet)."""
    if text is None:
        return None, None
    document = json.loads(text)
    processes = document.pop("processes", None)
    return document, processes


def note_findings(
    store: RunStore,
    project: str,
    run_id: str,
    findings: list[Finding],
    now: float,
    processes: list[dict[str, Any]] | None = None,
) -> None:
    """Keep the counts by severity of a run's full summary's ``findings`` on its record, for the runs
    index, with its ``processes`` (the summary's rows) by the strip's states."""
    from shared.processes.records import strip_counts

    counts = severity_counts([f["severity"] for f in findings])
    text = findings_text(counts, strip_counts(processes, findings) if processes else None)
    noted = _noted_findings.setdefault(store, {})
    last = noted.get((project, run_id))
    if last is not None and last[0] == text and now - last[1] < FINDINGS_REWRITE_S:
        return
    store.note_findings(project, run_id, text, now)
    remember(noted, (project, run_id), (text, now))
