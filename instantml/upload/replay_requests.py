"""What the :class:`~instantml.upload.replay.Replayer` sends: a spool's lines parsed into the requests they
carry (:class:`Line`), the requests held for another attempt (:class:`Held`), and the order a run
update keeps among them (:func:`may_attempt`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from instantml import routes
from instantml.upload import spool, transport

#: What a spool line may request, as (method, its path, where it is sent): rank events and scalars
#: through their batch routes, run updates (config, finished) one by one to the run's own route.
KINDS = (
    ("POST", routes.path_pattern(routes.RANK_METRICS), routes.RANK_METRICS_BATCH),
    ("POST", routes.path_pattern(routes.SCALARS), routes.SCALARS_BATCH),
    ("PATCH", routes.path_pattern(routes.RUN), routes.RUN),
)


def _destination(method: object, path: str) -> str | None:
    """Where a spool line's request is sent (a path), or None when this client sends no such request."""
    for kind_method, pattern, route in KINDS:
        found = pattern.match(path) if method == kind_method else None
        if found:
            return route.format(**found.groupdict())
    return None


@dataclass
class Line:
    raw: bytes
    end: int  # offset just after this line in its file
    event: dict[str, Any] | None  # the batch event (body + event_id), None if unreadable
    url_path: str = ""
    problem: str = ""
    method: str = "POST"  # POST: an event sent in a batch; PATCH: a run update sent alone

    @property
    def start(self) -> int:
        return self.end - len(self.raw)


@dataclass
class Held:
    """A request that failed transiently and waits for its next attempt: one run update, or one batch
    of events of one route."""

    lines: list[Line]
    attempts: transport.Attempts = field(default_factory=transport.Attempts)

    @property
    def update(self) -> bool:
        return self.lines[0].method == "PATCH"

    @property
    def fields(self) -> frozenset[str]:
        event = self.lines[0].event or {}
        return frozenset(event) - {"event_id", "time"}

    @property
    def what(self) -> str:
        if self.update:
            return "run update (" + ", ".join(sorted(self.fields)) + ")"
        return f"batch of {len(self.lines)} event(s)"


def may_attempt(held: list[Held], item: Held, health: transport.Health) -> bool:
    """Whether ``item`` may be sent now given the held requests before it (of its file): a run update
    waits for every held event before it and for held updates of the same fields; it passes a held
    update of other fields (a ``finished`` mark passing a ``config``) only once that update failed
    again after the server took other requests (``Attempts.suspect``), so updates keep their order
    through an outage and its end."""
    if not item.update:
        return True
    for earlier in held:
        if earlier is item:
            return True
        if not earlier.update or earlier.fields & item.fields:
            return False
        if not earlier.attempts.suspect:
            return False
    return True


def parse(chunk: spool.Chunk) -> list[Line]:
    """A chunk's lines as the requests they carry; a line this client does not write is kept, with its
    problem, to be rejected in its place."""
    out: list[Line] = []
    end = chunk.start
    for raw in chunk.lines:
        end += len(raw)
        try:
            obj = json.loads(raw)
            method, path = obj.get("method"), obj["path"]
            url_path = _destination(method, path)
            if obj.get("v") != 1 or url_path is None:
                raise ValueError(f"not a request event this client sends: {method} {path!r}")
            event = dict(obj["body"])
            event["event_id"] = str(obj["event_id"])
            out.append(Line(raw, end, event, url_path, method=method))
        except (ValueError, KeyError, TypeError) as exc:
            out.append(Line(raw, end, None, problem=f"unreadable spool line: {exc}"))
    return out


#: What names a process in its records (``instantml.monitor.records.identity``): a report of its end
#: carries the same.
WHO = ("rank", "world_size", "local_rank", "pid", "attempt", "host")
#: How the batch route of rank events ends (``/rank-metrics/batch``).
_RANK_EVENTS = routes.RANK_METRICS_BATCH.rsplit("}", 1)[-1]


@dataclass
class Writer:
    """What a spool file's lines said of the process that wrote them (contract 8): who it is (from its
    last process record), the last step it logged, and whether it recorded its end. The uploader reports
    a writer that is gone without one (:meth:`gone_report`)."""

    who: dict[str, Any] | None = None
    run_path: str = ""
    step: int | None = None
    ended: bool = False

    def note(self, lines: list[Line]) -> None:
        for line in lines:
            event = line.event
            if event is None:
                continue
            # The steps of rank events and of process records (``run.log`` scalars count their own).
            rank_event = line.method == "POST" and line.url_path.endswith(_RANK_EVENTS)
            step = event.get("step") if rank_event else (event.get("process") or {}).get("step")
            if isinstance(step, int) and (self.step is None or step > self.step):
                self.step = step
            process = event.get("process") if line.method == "PATCH" else None
            if isinstance(process, dict):
                self.who = {k: process[k] for k in WHO if process.get(k) is not None}
                self.run_path = line.url_path
                self.ended = self.ended or process.get("state") == "ended"

    def gone_report(self, last_sign_of_life: float, event_id: str) -> str | None:
        """The spool line of an ``ended`` record with ``how: vanished`` for a writer that is gone
        without its own (None if it recorded its end, or never said who it is), dated at its last sign
        of life (its file's last write)."""
        if self.ended or self.who is None or not self.run_path:
            return None
        process = {**self.who, "state": "ended", "how": "vanished", "step": self.step}
        body = {"process": {k: v for k, v in process.items() if v is not None}, "time": last_sign_of_life}
        line = {"v": 1, "event_id": event_id, "method": "PATCH", "path": self.run_path, "body": body}
        return json.dumps(line, allow_nan=False, separators=(",", ":")) + "\n"


def writer_of(path: Path, until: int) -> Writer:
    """What the lines of ``path`` before ``until`` said of their writer, read again (for an uploader
    that did not send them itself: another sent them before it started). Only the lines that carry a
    process record are parsed."""
    writer = Writer()
    offset = 0
    while offset < until:
        chunk, _ = spool.read_lines(path, offset, 4 * 1024 * 1024)
        if not chunk.lines:
            break
        end = chunk.start
        for raw in chunk.lines:
            end += len(raw)
            if end > until:
                return writer
            if b'"process"' in raw:
                writer.note(parse(spool.Chunk(end - len(raw), end, [raw])))
        offset = chunk.end
    return writer
