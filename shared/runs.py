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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, TypeVar, get_args

from instantml import limits
from shared.errors import (
    FieldError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    StoreThrottled,
    StoreUnavailable,
)
from shared.events import Event, ScalarEvent
from shared.severity import Severity, severity_counts
from shared.store.port import RunActivity, RunRecord, RunStatus, RunStore

if TYPE_CHECKING:
    from shared.findings import Finding

#: A run that is not finished and has had no event for this long is ``idle``, else ``live``.
IDLE_AFTER_S = 300.0
DEFAULT_LIMIT, MAX_LIMIT = 50, 200
STATUSES: tuple[str, ...] = get_args(RunStatus)
#: A run update is its config and a few fields around it.
MAX_UPDATE_BYTES = limits.MAX_CONFIG_BYTES + 1024


def activity(events: Sequence[Event], now: float) -> RunActivity:
    """What accepted events, all of one kind (stored or replayed: noting twice changes nothing), say
    about their run: scalars only its time. Event times are the clients'; a clock ahead of the server's
    counts as now."""
    latest = min(max(e.time for e in events), now)
    if isinstance(events[0], ScalarEvent):
        return RunActivity(latest)
    step = max(e.step for e in events)
    at_step = [e for e in events if e.step == step]
    return RunActivity(latest, step, frozenset(e.rank for e in at_step), max(e.world_size for e in at_step))


#: ``last_event`` is kept to this resolution: a process notes a run's time at most once a second.
ACTIVITY_RESOLUTION_S = 1.0
#: Runs whose last note a process remembers.
NOTED_RUNS = 10_000

_V = TypeVar("_V")


def _remember(notes: dict[tuple[str, str], _V], key: tuple[str, str], value: _V) -> None:
    """Keep ``value`` as the run's newest note, and forget the run noted longest ago beyond ``NOTED_RUNS``
    (a dict keeps its order of insertion: the first key is the oldest)."""
    notes.pop(key, None)
    notes[key] = value
    if len(notes) > NOTED_RUNS:
        del notes[next(iter(notes))]


class _Noted(NamedTuple):
    """A run's record as this process last noted it, its ranks as a bit mask (512 ranks: 64 bytes, where
    a set of them takes 30 KB, times ``NOTED_RUNS``)."""

    time: float
    step: int | None
    ranks: int
    world_size: int | None


def _bits(ranks: frozenset[int]) -> int:
    bits = 0
    for rank in ranks:
        bits |= 1 << rank
    return bits


class ActivityNotes:
    """What this process last noted per run, so that a batch that cannot change a run's record does not
    write it: a replayed or late batch, a rank already noted at the newest step, a time within a second.
    Only what the store acknowledged is remembered, and the store's record only grows, so a skipped note
    never loses anything but a sub-second ``last_event``.

    ``hold_time_s`` (the store's ``run_time_resolution_s``): a note whose step part is new but whose
    time is within that long of the time this process noted carries the noted time instead, so a store
    that keeps the run's time on one hot item (DynamoDB, where both runs indexes hold it) writes that
    item about once a second per process, however many ranks report; the step part is written as it
    comes. 0 keeps every time as it comes.

    A note the store throttles or fails is kept and folded into the run's next note (``merge``): the
    events it came with are stored, so their request must not be answered 429 or 503 for it."""

    def __init__(self, hold_time_s: float = 0.0) -> None:
        self._noted: dict[tuple[str, str], _Noted] = {}
        self._pending: dict[tuple[str, str], RunActivity] = {}
        self.hold_time_s = hold_time_s

    def note_events(
        self, store: RunStore, project: str, run_id: str, events: Sequence[Event], now: float
    ) -> bool:
        """``note`` the ``activity`` of accepted events."""
        return self.note(store, project, run_id, activity(events, now))

    def note(self, store: RunStore, project: str, run_id: str, new: RunActivity) -> bool:
        """Note ``new`` (with what is pending for the run); False when the store refused it, which then
        waits for the run's next note."""
        key = (project, run_id)
        pending = self._pending.pop(key, None)
        if pending is not None:
            new = merge(pending, new)
        old = self._noted.get(key)
        bits = _bits(new.ranks)
        if old is not None and pending is None and _adds_nothing(old, new, bits):
            return True
        if self.hold_time_s > 0 and old is not None and new.time <= old.time + self.hold_time_s:
            new = new._replace(time=min(new.time, old.time))
        try:
            store.note_activity(project, run_id, new)
        except (StoreThrottled, StoreUnavailable):
            _remember(self._pending, key, new)
            return False
        noted = _Noted(new.time, new.step, bits, new.world_size)
        if old is not None:
            if old.step is not None and (new.step is None or new.step < old.step):
                noted = old._replace(time=new.time)
            elif new.step is not None and new.step == old.step:
                sizes = [s for s in (old.world_size, new.world_size) if s is not None]
                noted = noted._replace(ranks=old.ranks | bits, world_size=max(sizes) if sizes else None)
            noted = noted._replace(time=max(noted.time, old.time))
        _remember(self._noted, key, noted)
        return True


def merge(a: RunActivity, b: RunActivity) -> RunActivity:
    """One activity that notes what ``a`` and ``b`` each would (noting is a merge that only grows)."""
    time = max(a.time, b.time)
    if a.step is None and b.step is None:
        return a._replace(time=time)
    if a.step is None or (b.step is not None and b.step > a.step):
        return b._replace(time=time)
    if b.step is None or b.step < a.step:
        return a._replace(time=time)
    sizes = [s for s in (a.world_size, b.world_size) if s is not None]
    return RunActivity(time, a.step, a.ranks | b.ranks, max(sizes) if sizes else None)


def _adds_nothing(old: _Noted, new: RunActivity, bits: int) -> bool:
    if new.time > old.time + ACTIVITY_RESOLUTION_S:
        return False
    if new.step is None or (old.step is not None and new.step < old.step):
        return True
    if old.step is None or new.step > old.step:
        return False
    return bits & ~old.ranks == 0 and (new.world_size or 0) <= (old.world_size or 0)


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


class RunDocument(_RunRow, total=False):  # (total=False: see shared.findings.common.Finding)
    """A run as the API shows it (contract 3.3), its keys in the order written; one run alone has
    ``hosts`` and ``watch`` too."""

    hosts: dict[str, str]
    watch: WatchView | None


class RunsPage(TypedDict):
    """``GET .../runs``."""

    runs: list[RunDocument]
    next_cursor: str | None
    idle_after_s: float


def run_json(record: RunRecord, now: float, detail: bool = False) -> RunDocument:
    """A record as the API shows it (contract 3.3); ``detail`` adds what the watch keeps of it."""
    document: RunDocument = {
        "run_id": record.run_id,
        "created": record.created,
        "last_event": record.last_event,
        "last_step": record.last_step,
        "world_size": record.world_size,
        "ranks_reporting": record.ranks_reporting,
        "status": status(record, now),
        "finished": record.finished,
        "findings": None if record.findings is None else json.loads(record.findings),
        "findings_at": record.findings_at,
        "config": None if record.config is None else json.loads(record.config),
        "headline": record.headline,
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
    from shared.query import Params  # (with the summary's query: numpy, which the ingest never needs)

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
    return run_json(record, now, detail=True)


def update_run(store: RunStore, project: str, run_id: str, raw: bytes, now: float) -> RunDocument:
    """``PATCH .../runs/{run_id}``: record the run's config, that it finished, and/or the hosts of some
    of its ranks."""
    if len(raw) > MAX_UPDATE_BYTES:
        raise PayloadTooLarge(
            f"a run update may be at most {MAX_UPDATE_BYTES} bytes, got {len(raw)}",
            [FieldError("config", f"must be at most {limits.MAX_CONFIG_BYTES} bytes as compact JSON")],
        )
    from shared.bodies import RunUpdateBody, validate  # (pydantic: at the first update)
    from shared.json_body import parse_json

    body = validate(RunUpdateBody, parse_json(raw), "run update")
    if body.config is None and body.status is None and body.hosts is None:
        message = "send 'config' (an object), 'status': 'finished' and/or 'hosts' (rank -> host)"
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
    record = store.update_run(project, run_id, time, config, finished=body.status == "finished", hosts=hosts)
    return run_json(record, now)


#: The tab asks for a live run's summary every 5 s: a function instance rewrites unchanged counts at
#: most this often (another instance's newer counts are then at most this old).
FINDINGS_REWRITE_S = 60.0
_noted_findings: weakref.WeakKeyDictionary[RunStore, dict[tuple[str, str], tuple[str, float]]] = (
    weakref.WeakKeyDictionary()
)


def note_findings(store: RunStore, project: str, run_id: str, findings: list[Finding], now: float) -> None:
    """Keep the counts by severity of a run's full summary's ``findings`` on its record, for the runs
    index."""
    counts = severity_counts([f["severity"] for f in findings])
    text = json.dumps(counts, separators=(",", ":"))
    noted = _noted_findings.setdefault(store, {})
    last = noted.get((project, run_id))
    if last is not None and last[0] == text and now - last[1] < FINDINGS_REWRITE_S:
        return
    store.note_findings(project, run_id, text, now)
    _remember(noted, (project, run_id), (text, now))
