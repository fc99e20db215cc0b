"""The events as stored: one rank's metric batch for one global step (:class:`RankEvent`), and one
``run.log`` call's scalars (:class:`ScalarEvent`). Plain dataclasses, built once a request's body is
validated (``shared.ingest.parse``); the stores, the summary and the watch use them without pydantic."""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

# Named tuples, not frozen dataclasses: ingest builds one per event, and a named tuple is built in a
# fifth of the time (a frozen dataclass sets each field through object.__setattr__).


class RankEvent(NamedTuple):
    """One rank's metric batch for one global step (``run.log_rank_metrics``)."""

    project: str
    run_id: str
    event_id: str
    step: int
    rank: int
    world_size: int
    local_rank: int | None
    weight: float
    time: float
    keys: tuple[str, ...]
    values: tuple[float, ...]
    #: Digest of what the client sent: tells a retry (same digest) from a reused id (another one).
    payload_digest: bytes


class ScalarEvent(NamedTuple):
    """One ``run.log`` call's scalars: a rank's values at a step, with no world and no weight."""

    project: str
    run_id: str
    event_id: str
    step: int
    rank: int
    time: float
    keys: tuple[str, ...]
    values: tuple[float, ...]
    payload_digest: bytes

    # The stores keep scalars in rows and items laid out as rank events' (one codec, one conditional
    # put); these are what a scalar holds in the fields it lacks.
    @property
    def world_size(self) -> int:
        return 0

    @property
    def local_rank(self) -> None:
        return None

    @property
    def weight(self) -> float:
        return 1.0


Event: TypeAlias = RankEvent | ScalarEvent
#: What a write route stores: its request's events are all of one kind.
EventKind: TypeAlias = type[RankEvent] | type[ScalarEvent]
