"""The store port: what the ingest, summary and rollup logic need from storage, and nothing more.

The logic receives an object with these methods and never imports boto3 or sqlite3. Two adapters
implement them with the same semantics, held to one contract suite (tests/contract):

- ``shared.store.dynamodb``: the deployed layout (one conditional put per event, 16 shards per run);
- ``shared.store.sqlite``: one SQLite database in WAL mode, for ``instantml local``.

Three kinds of data: rank events (``EventStore``), the run's ordinary scalars of ``run.log``
(``ScalarStore``: ``ScalarEvent``, stored in the rank events' layout and kept apart from them),
and one record per run (``RunStore``: activity, config, lifecycle and findings counts, kept on write so
that listing a project's runs never reads their events).

Every method speaks in domain types (``RankEvent`` and ``ScalarEvent`` in, ``StoredEvent`` and rollup
blocks out). A store
that throttles raises ``StoreThrottled`` (429), one that fails or does not answer ``StoreUnavailable``
(503); every write is idempotent, so the caller's retry is always safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, TypeAlias

if TYPE_CHECKING:  # names only: a function that needs no pydantic nor numpy imports neither through here
    from shared.errors import EventIdReused
    from shared.events import RankEvent, ScalarEvent
    from shared.rollups import BlockHeader, RolledBlock
    from shared.severity import Severity

#: One outcome per event of ``put_events``: new, a replay of the same payload, or an id reused.
PutOutcome: TypeAlias = 'Literal["stored", "duplicate"] | EventIdReused'


class StoredEvent(NamedTuple):
    """One stored event as the summary reads it: the values still packed. (A named tuple: a summary
    makes one per event, and a tuple is several times cheaper to make than a frozen dataclass.)"""

    event_id: str
    step: int
    rank: int
    world_size: int
    keys: list[str]  # events read together share one list per distinct key list
    packed: bytes  # little-endian float64 [weight, time, *values]
    local_rank: int | None = None  # the rank's place on its node (a node's first rank is rank - local_rank)


@dataclass(frozen=True, slots=True)
class EventPage:
    """Events of a step window. ``complete_through`` is None when the whole window was read, else the
    last step through which it is complete (a read capped by ``max_items`` stopped after it)."""

    events: list[StoredEvent]
    complete_through: int | None = None


#: Where a raw read goes on from: the (step, rank, event_id) of the last event it passed. A rank past
#: every rank (``instantml.limits.MAX_WORLD_SIZE``) with an empty id stands for "after the whole step".
Position: TypeAlias = "tuple[int, int, str]"


class RowsWanted(NamedTuple):
    """What a raw read (``read_event_rows`` / ``read_scalar_rows``) asks for: the run's events with
    ``step_min <= step <= step_max``, after ``after``, of ``ranks`` only when given (an empty set
    wants none), ``max_items`` of them at most."""

    project: str
    run_id: str
    step_min: int = 0
    step_max: int | None = None
    after: Position | None = None
    ranks: frozenset[int] | None = None
    max_items: int = 1


class EventRows(NamedTuple):
    """Stored events by column in (step, rank, event_id) order, as the raw route reads them (contract 9):
    a column per field, no object per event. ``keys[i]`` is event i's key list (events with the same
    keys share one list object); ``packed[i]`` its little-endian float64 ``[weight, time, *values]``.
    ``resume`` is where the next read starts after this one, None when the window holds nothing more."""

    event_id: list[str]
    step: list[int]
    rank: list[int]
    world_size: list[int]
    local_rank: list[int | None]
    keys: list[list[str]]
    packed: list[bytes]
    resume: Position | None


class EventStore(Protocol):
    def put_events(self, events: list[RankEvent]) -> list[PutOutcome]:
        """Store each event once, one outcome per event in order.

        Same id and payload as a stored event: ``"duplicate"``; same id, another payload: that event's
        outcome is ``EventIdReused``. A store failure raises for the whole batch; what was stored before
        it is durable, and a retry of the batch finds it as ``"duplicate"``.
        """
        ...

    def read_events(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """The run's events with ``step_min <= step <= step_max``, at most about ``max_items`` of them
        (then cut at a whole step: ``complete_through``). Touches only this run."""
        ...

    def read_event_rows(self, wanted: RowsWanted) -> EventRows:
        """The first ``wanted.max_items`` events (at most) of the window after ``wanted.after``, in
        (step, rank, event_id) order; a read's cost follows what it returns, never the run's length or
        how far into it ``after`` is."""
        ...

    def next_step(self, project: str, run_id: str, step_min: int, step_max: int | None = None) -> int | None:
        """The smallest stored step of the run in ``[step_min, step_max]``, None when there is none.

        Lets work follow the steps that exist, never the numeric range between them."""
        ...


class ScalarStore(Protocol):
    """``run.log`` scalars (one logger, no world), stored once per id as rank events are, and never
    mixed with them."""

    def put_scalars(self, events: list[ScalarEvent]) -> list[PutOutcome]:
        """As ``put_events``, for scalar events."""
        ...

    def read_scalars(
        self,
        project: str,
        run_id: str,
        step_min: int = 0,
        step_max: int | None = None,
        max_items: int | None = None,
    ) -> EventPage:
        """As ``read_events``, for scalar events."""
        ...

    def read_scalar_rows(self, wanted: RowsWanted) -> EventRows:
        """As ``read_event_rows``, for scalar events."""
        ...


class RunActivity(NamedTuple):
    """What newly accepted events say about their run (noting it twice changes nothing)."""

    time: float  # the latest event time (capped at the server's clock)
    step: int | None = None  # the largest step of the rank events, None for scalars only
    ranks: frozenset[int] = frozenset()  # ranks with a rank event at ``step``
    world_size: int | None = None  # the world size of those events


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run as the runs index lists it (contract 3.3); ``config`` and ``findings`` as stored JSON."""

    run_id: str
    created: float
    last_event: float
    last_step: int | None = None
    world_size: int | None = None
    ranks_reporting: int | None = None
    finished: float | None = None
    config: str | None = None  # a JSON object
    findings: str | None = None  # a JSON object: severity -> count
    findings_at: float | None = None
    received: float | None = None  # the server's clock at the run's last event or update received
    watch: str | None = None  # the watch's state (``shared.watch.rounds.WatchState`` as JSON)
    headline: str | None = None  # the worst finding in a few words, e.g. "rank 5 stopped"
    hosts: dict[int, str] | None = None  # rank -> the host it said it runs on (run updates' ``hosts``)


#: What ``list_runs`` can filter on.
RunStatus = Literal["live", "idle", "finished"]


class RunStore(Protocol):
    #: How long a note's time may be held back when it has a step part
    #: (``shared.ingest.activity.ActivityNotes`` then notes the time as already recorded, and the store
    #: may leave out a time within this long of the one it holds): 0 notes every time as it comes
    #: (SQLite, where a write costs microseconds); DynamoDB's 1 s keeps the run's indexed item to about
    #: one write a second, however many processes note it.
    run_time_resolution_s: float

    def note_activity(self, project: str, run_id: str, activity: RunActivity) -> None:
        """Fold accepted events into the run's record, made when new: ``last_event`` and ``last_step``
        only grow; the ranks at the last step are a union; ``created`` is set once."""
        ...

    def update_run(
        self,
        project: str,
        run_id: str,
        time: float,
        config: str | None = None,
        finished: bool = False,
        hosts: dict[int, str] | None = None,
    ) -> RunRecord:
        """Set the run's config (JSON text; the last one written wins), mark it finished (the first
        time counts), and/or set the hosts of some ranks (each rank's last one wins; the others' stay),
        made when new; ``time`` counts as activity. Returns the record."""
        ...

    def note_findings(self, project: str, run_id: str, findings: str, at: float) -> None:
        """Record the counts of the run's latest full summary (kept only when newer); nothing for a run
        that has no record."""
        ...

    def get_run(self, project: str, run_id: str) -> RunRecord | None: ...

    def update_process(
        self, project: str, run_id: str, rank: int, change: Callable[[str | None], str | None]
    ) -> None:
        """Replace the document of the run's process at ``rank`` (contract 8; JSON text, at most a few KB)
        with ``change(kept)`` (kept: None when there is none), atomically with respect to other updates
        of it; ``change`` returning None leaves it as it is."""
        ...

    def processes(self, project: str, run_id: str) -> dict[int, str]:
        """The documents of the run's processes, by rank (empty for a run without any)."""
        ...

    def list_runs(
        self,
        project: str,
        limit: int,
        after: tuple[float, str] | None = None,
        statuses: frozenset[RunStatus] | None = None,
        idle_before: float = 0.0,
    ) -> list[RunRecord]:
        """The project's runs, newest ``last_event`` first (ties: larger run id first), strictly after
        the ``(last_event, run_id)`` cursor, at most ``limit``. ``statuses`` filters: finished runs are
        those marked finished; the others are idle when ``last_event < idle_before``, else live."""
        ...


@dataclass(frozen=True)
class Webhook:
    url: str
    min_severity: Severity = "warning"


#: How the last POST to a webhook went (``GET .../alerts``): ``delivered``; ``failing`` (retried);
#: ``refused`` by the outgoing-request policy (``shared.watch.egress``: never retried).
DeliveryState = Literal["delivered", "failing", "refused"]


class LastDelivery(NamedTuple):
    state: DeliveryState
    reason: str | None
    at: float


@dataclass(frozen=True)
class Delivery:
    """One POST to one webhook. ``delivery_id`` names it: the same decision always gets the same id,
    and it travels as the ``X-InstantML-Delivery`` header so that a receiver may drop a repeat."""

    delivery_id: str
    project: str
    url: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class PendingDelivery:
    delivery: Delivery
    created: float
    attempts: int


class RollupProgress(NamedTuple):
    """How far a run's rollups go: every event the rollups were made from at a step up to ``step`` is in
    every level (-1: none yet); ``nodes``, per rank, the first rank of its node (``int32`` little-endian,
    -1 where no event said), from the events rolled up."""

    step: int = -1
    nodes: bytes = b""


class RollupStore(Protocol):
    """The levels of rollups (``shared.rollups``): blocks of ``size`` steps, numbered ``step //
    size``."""

    def read_blocks(self, project: str, run_id: str, size: int, first: int, last: int) -> list[BlockHeader]:
        """The rolled blocks of one level, ``first <= block <= last``, in block order."""
        ...

    def read_block_sums(
        self, project: str, run_id: str, size: int, keys: list[str], first: int, last: int
    ) -> dict[str, dict[int, bytes]]:
        """For each key, block -> packed sums (``rollups.pack_key_units``), of one level."""
        ...

    def write_blocks(self, project: str, run_id: str, rolled: list[RolledBlock]) -> None:
        """Store rolled blocks (each header names its level); of two rollups of one block, the one that
        read more events is kept."""
        ...

    def rollup_progress(self, project: str, run_id: str) -> RollupProgress: ...

    def late_steps(self, project: str, run_id: str, step_min: int, step_max: int, limit: int) -> list[int]:
        """Steps ``step_min..step_max`` (at most ``limit``, ascending) holding events that arrived after
        their step was rolled up and are not in its blocks yet (a rank uploading late: its spool synced
        after the others'): a summary reads those steps event by event until the rollups catch up. A
        store that cannot see the rollups' backlog (DynamoDB: the stream's) returns none."""
        ...

    def advance_rollups(self, project: str, run_id: str, step: int, nodes: bytes) -> None:
        """Record progress: ``step`` never moves back; ``nodes`` replaces the stored ones."""
        ...


class AlertStore(Protocol):
    """A project's alert destinations (contract 7)."""

    def get_webhooks(self, project: str) -> list[Webhook]: ...

    def put_webhooks(self, project: str, webhooks: list[Webhook]) -> None:
        """Replace the project's webhooks."""
        ...

    def delete_webhooks(self, project: str) -> bool:
        """Remove them (and what their deliveries noted); False when there were none."""
        ...

    def note_delivery(self, project: str, url: str, last: LastDelivery) -> None:
        """Keep how the last POST to the project's webhook ``url`` went (one small record per webhook,
        overwritten); nothing when the project has no webhooks any more."""
        ...

    def last_deliveries(self, project: str) -> dict[str, LastDelivery]:
        """The project's webhooks' last deliveries, by URL (a webhook never sent to is absent)."""
        ...


class IngestStore(EventStore, ScalarStore, RunStore, Protocol):
    """What the write routes use (``shared.ingest.writes``): the events, the scalars, and the run's record."""


class ScalarsReadStore(ScalarStore, RunStore, Protocol):
    """What ``GET .../scalars`` reads (``shared.summary.scalars``): the scalars, and whether the run
    exists."""


class SummaryStore(EventStore, RollupStore, Protocol):
    """What a Distributed summary reads: events and rollups."""


class WatchStore(SummaryStore, AlertStore, Protocol):
    """What the watch (``shared.watch.rounds``) needs: the runs to watch, their events and rollups, the
    projects' webhooks, and where a round's result goes."""

    def processes(self, project: str, run_id: str) -> dict[int, str]:
        """As ``RunStore.processes``."""
        ...

    def watched_runs(self, received_after: float, limit: int) -> list[tuple[str, RunRecord]]:
        """Runs with an event or update received at or after ``received_after`` (server clock), most
        recent first, with the project of each."""
        ...

    def save_watch(
        self,
        project: str,
        run_id: str,
        state: str,
        counts: str,
        headline: str | None,
        at: float,
        deliveries: list[Delivery],
    ) -> None:
        """Keep a round's result in the run's record (its state, findings counts and headline) and
        queue its deliveries (an outbox), so that neither is kept without the other."""
        ...


class MetricsStore(ScalarStore, RunStore, WatchStore, Protocol):
    """Every part: what an adapter implements (each function is given the part it uses)."""
