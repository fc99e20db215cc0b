"""Reading runs back into Python (contract 9): ``im.Api``, with the same defaults as ``im.init``.

>>> import instantml as im
>>> api = im.Api()                                   # INSTANTML_API_URL, INSTANTML_API_KEY
>>> for info in api.runs("distributed-job"):        # every run, pages followed
...     print(info.run_id, info.status, info.findings)
>>> run = api.run("distributed-job", "r1")
>>> loss = run.rank_metrics(keys=["train/loss"]).to_numpy("train/loss")   # ranks x steps, NaN gaps
>>> frame = run.rank_metrics().to_pandas()           # step, rank, key, value, weight, time, event_id

Values come back exactly as logged (float64, NaN and Infinity included), streamed a page at a time, so
iterating a long run holds one page in memory. Standard library only: numpy and pandas are imported by
``to_numpy`` and ``to_pandas`` alone (``pip install 'instantml[read]'``).
"""

from __future__ import annotations

import base64
import os
import sys
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote, urlencode

from instantml import limits, routes, settings
from instantml.upload import transport

if TYPE_CHECKING:
    import numpy
    import pandas

#: Transient failures (network, 429, 5xx) are retried this many times, honouring Retry-After.
ATTEMPTS = 5
#: Events asked for per page: the most the route reads (its pages stop at 100,000 values anyway).
PAGE_EVENTS = 100_000
#: Step windows ``to_numpy`` reads at once.
PARALLEL_READS = 4
#: Step windows ``pages_ahead`` cuts a read into at most.
READ_WINDOWS = 1024


class ApiError(Exception):
    """A request the server refused or could not answer; the message says what to do."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Row(NamedTuple):
    """One stored value: the long form ``to_pandas`` gives."""

    step: int
    rank: int
    key: str
    value: float
    weight: float
    time: float
    event_id: str


@dataclass(frozen=True)
class RunInfo:
    """A run as ``GET .../runs`` lists it; ``record`` is the whole document."""

    run_id: str
    status: str
    world_size: int | None
    last_step: int | None
    findings: dict[str, int] | None
    config: dict[str, Any] | None
    record: dict[str, Any] = field(repr=False)
    #: The processes by state at the watch's latest look (``{"running": 6, "vanished": 2}``), or None.
    process_states: dict[str, int] | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> RunInfo:
        return cls(
            record["run_id"],
            record.get("status", ""),
            record.get("world_size"),
            record.get("last_step"),
            record.get("findings"),
            record.get("config"),
            record,
            record.get("process_states"),
        )


class Api:
    """The server's read routes, for one API URL and token."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None, timeout: float = 60.0):
        url = api_url or os.environ.get(settings.API_URL_ENV)
        key = api_key or os.environ.get(settings.API_KEY_ENV)
        if not url:
            raise ApiError(f"no API URL: pass api_url= or set {settings.API_URL_ENV}")
        if not key:
            raise ApiError(f"no token: pass api_key= or set {settings.API_KEY_ENV}")
        self.api_url, self._key, self.timeout = url.rstrip("/"), key, timeout

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """One GET of the API (``path`` already quoted), retried while the failure is transient."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        url = self.api_url + path + (f"?{urlencode(query)}" if query else "")
        for attempt in range(ATTEMPTS):
            try:
                return transport.request("GET", url, self._key, timeout=self.timeout)
            except transport.Refused as exc:
                raise self._refused(exc, path) from None
            except transport.Transient as exc:
                if attempt + 1 == ATTEMPTS:
                    where = f"the server at {self.api_url}"
                    raise ApiError(
                        f"{where} did not answer ({exc}); is it running (instantml local) and is "
                        f"{settings.API_URL_ENV} right?",
                        exc.status,
                    ) from None
                time.sleep(transport.backoff(attempt, exc.retry_after, cap=5.0))
        raise AssertionError("unreachable")

    def _refused(self, exc: transport.Refused, path: str) -> ApiError:
        message = exc.error.get("message", "")
        code = exc.error.get("code")
        if exc.status == 401:
            hint = f"the token was refused ({message}): pass api_key= or set {settings.API_KEY_ENV}"
        elif exc.status == 403:
            hint = f"this token does not grant that project ({message}): use a token of the project"
        elif exc.status == 404:
            hint = f"not found: {message or path}"
        else:
            hint = f"HTTP {exc.status}: {message}"
        return ApiError(hint, exc.status, code)

    def runs(self, project: str, status: str | None = None) -> Iterator[RunInfo]:
        """Every run of ``project``, newest activity first (``status``: live, idle or finished)."""
        path = routes.RUNS.format(project=quote(project, safe=""))
        cursor: str | None = None
        while True:
            page = self.get(path, {"limit": 200, "cursor": cursor, "status": status})
            yield from (RunInfo.of(r) for r in page["runs"])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def run(self, project: str, run_id: str) -> Run:
        """One run: its record (read now: an unknown run is an ``ApiError`` here), summary and values."""
        return Run(self, project, run_id)


class Run:
    """A run on the server; ``record`` is its document (config, status, world size, findings)."""

    def __init__(self, api: Api, project: str, run_id: str) -> None:
        self.api, self.project, self.run_id = api, project, run_id
        names = {"project": quote(project, safe=""), "run_id": quote(run_id, safe="")}
        self._paths = {
            route: route.format(**names)
            for route in (routes.RUN, routes.DISTRIBUTED, routes.RANK_METRICS, routes.SCALARS)
        }
        self.record: dict[str, Any] = api.get(self._paths[routes.RUN])

    @property
    def config(self) -> dict[str, Any] | None:
        config: dict[str, Any] | None = self.record.get("config")
        return config

    @property
    def status(self) -> str:
        return str(self.record.get("status", ""))

    def summary(self, **params: Any) -> dict[str, Any]:
        """The Distributed summary (contract 5); ``params`` as its query (``keys`` may be a list)."""
        if isinstance(params.get("keys"), list | tuple):
            params["keys"] = ",".join(params["keys"])
        summary: dict[str, Any] = self.api.get(self._paths[routes.DISTRIBUTED], params)
        return summary

    def rank_metrics(
        self,
        keys: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        step_min: int | None = None,
        step_max: int | None = None,
    ) -> Values:
        """Every stored rank value in the window, streamed when iterated (``Row``s by step and rank)."""
        return Values(self, self._paths[routes.RANK_METRICS], {}, keys, ranks, step_min, step_max)

    def scalars(
        self, keys: Iterable[str] | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> Values:
        """Every stored ``run.log`` value, as ``rank_metrics`` gives rank values."""
        return Values(self, self._paths[routes.SCALARS], {"raw": "1"}, keys, None, step_min, step_max)


class Values:
    """Stored values of a run, read a page at a time whenever iterated."""

    def __init__(
        self,
        run: Run,
        path: str,
        extra: dict[str, str],
        keys: Iterable[str] | None,
        ranks: Iterable[int] | None,
        step_min: int | None,
        step_max: int | None,
    ) -> None:
        self.run, self._path, self._extra = run, path, extra
        self.keys = None if keys is None else tuple(keys)
        self._ranks = None if ranks is None else tuple(int(r) for r in ranks)
        self._window = (step_min, step_max)
        self._steps: dict[str, Any] = {}
        if self.keys is not None:
            bad = [k for k in self.keys if not limits.is_valid_key(k) or "," in k]
            if bad:
                raise ApiError(f"keys: {bad[0]!r} is not a key this route can be asked for")
        self._params: dict[str, Any] = {
            **extra,
            "keys": None if self.keys is None else ",".join(self.keys),
            "ranks": None if self._ranks is None else ",".join(map(str, self._ranks)),
            "step_min": step_min,
            "step_max": step_max,
        }

    def pages(self, limit: int | None = PAGE_EVENTS, cursor: str | None = None) -> Iterator[Page]:
        """The pages as the server sends them (contract 9, ``encoding=base64``), decoded, following
        ``next_cursor`` (from ``cursor`` on, when given)."""
        while True:
            page, cursor = self._page(limit, cursor)
            yield page
            if not cursor:
                return

    def _page(self, limit: int | None, cursor: str | None) -> tuple[Page, str | None]:
        params = {**self._params, "limit": limit, "cursor": cursor, "encoding": "base64"}
        document: dict[str, Any] = self.run.api.get(self._path, params)
        return Page.of(document), document.get("next_cursor") or None

    def pages_ahead(self, parts: int = PARALLEL_READS, limit: int | None = PAGE_EVENTS) -> Iterator[Page]:
        """``pages()`` in the same order, read ahead. The first page tells how many steps a page holds;
        the rest of the read is cut into step windows of that many steps (about a page each), read by
        ``parts`` threads, at most ``2 x parts`` windows ahead of the caller (its memory: that many
        pages), so the server answers the next pages, several at once, while the caller handles this
        one. A window past the run's last step, as its record says, is left open to the end."""
        from collections import deque
        from concurrent.futures import Future, ThreadPoolExecutor

        first, cursor = self._page(limit, None)
        yield first
        if cursor is None:
            return
        windows = self._windows_after(first)
        if len(windows) == 1:
            yield from self.pages(limit, cursor)
            return

        def window(n: int) -> list[Page]:
            low, high = windows[n]
            values = Values(self.run, self._path, self._extra, self.keys, self._ranks, low, high)
            return list(values.pages(limit, cursor if n == 0 else None))

        pool = ThreadPoolExecutor(parts, thread_name_prefix="instantml-read")
        pending: deque[Future[list[Page]]] = deque()
        try:
            for n in range(len(windows)):
                pending.append(pool.submit(window, n))
                if len(pending) > 2 * parts:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:  # (a reader that stops early, or a failed window: the windows not begun never are)
            pool.shutdown(wait=False, cancel_futures=True)

    def _windows_after(self, first: Page) -> list[tuple[int | None, int | None]]:
        """The step windows after ``first`` (the first of them goes on from its cursor, inside its last
        step): each as many steps as ``first`` held whole, the last open to the read's end."""
        low, high = self._window
        last = self.run.record.get("last_step")
        end = last if high is None or not isinstance(last, int) else min(high, last)
        at = first.step[-1]  # the cursor's step: its events after the cursor come first
        span = max(1, first.step[-1] - first.step[0])
        if not isinstance(end, int) or at + span > end:
            return [(low, high)]
        # Sparse steps (a page of one step, the next at 2**53): the windows follow the steps' range, so
        # they are made wider, never more than READ_WINDOWS of them (each one pages itself anyway).
        span = max(span, -(-(end - at) // READ_WINDOWS))
        cuts = list(range(at + span, end + 1, span))
        return [*zip([low, *cuts[:-1]], [c - 1 for c in cuts], strict=True), (cuts[-1], high)]

    def __iter__(self) -> Iterator[Row]:
        for page in self.pages():
            for i, j, value in page.cells():
                yield Row(
                    page.step[i],
                    page.rank[i],
                    page.keys[j],
                    value,
                    page.weight[i],
                    page.time[i],
                    page.event_id[i],
                )

    def to_numpy(self, key: str) -> numpy.ndarray[Any, Any]:
        """``key``'s values as a ranks x steps float64 matrix (row r is rank r, columns ``steps(key)``),
        NaN where a rank did not report. Where a rank logged a step twice, the later time wins.

        The run's steps are read as ``PARALLEL_READS`` windows at once, each paged on its own (a page
        waits mostly on the server, which answers several at a time)."""
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        def window(bounds: tuple[int | None, int | None]) -> list[tuple[Any, ...]]:
            parts = []
            for page in Values(self.run, self._path, self._extra, [key], self._ranks, *bounds).pages():
                if key in page.keys:
                    j, k = page.keys.index(key), len(page.keys)
                    bits = np.unpackbits(np.frombuffer(page.present, np.uint8), count=page.count * k)
                    there = bits.reshape(page.count, k)[:, j].astype(bool)
                    values = np.frombuffer(page.values, "<f8").reshape(page.count, k)[:, j]
                    steps, ranks = np.asarray(page.step, np.int64), np.asarray(page.rank, np.int64)
                    times = np.frombuffer(page.time, "<f8")
                    parts.append((steps[there], ranks[there], times[there], values[there]))
            return parts

        windows = self._windows(PARALLEL_READS)
        with ThreadPoolExecutor(len(windows)) as pool:
            parts = [part for found in pool.map(window, windows) for part in found]
        steps, ranks, times, values = (
            (np.concatenate([p[n] for p in parts]) for n in range(4))
            if parts
            else (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
        )
        columns = np.unique(steps)
        self._steps[key] = columns
        matrix = np.full((int(ranks.max(initial=-1)) + 1, len(columns)), np.nan)
        order = np.lexsort((times, ranks, steps))  # a rank's later time last: it wins
        matrix[ranks[order], np.searchsorted(columns, steps[order])] = values[order]
        return matrix

    def _windows(self, parts: int) -> list[tuple[int | None, int | None]]:
        """The read's step window cut into up to ``parts`` windows of as many steps, by the run's last
        step as its record says (the last window open to the end, for the steps logged since)."""
        low, high = self._window
        last = self.run.record.get("last_step")
        first = low or 0
        end = last if high is None or not isinstance(last, int) else min(high, last)
        if not isinstance(end, int) or end - first < 2 * parts:
            return [(low, high)]
        cuts = [first + (end - first + 1) * n // parts for n in range(1, parts)]
        middle = zip(cuts[:-1], [c - 1 for c in cuts[1:]], strict=True)
        return [(low, cuts[0] - 1), *middle, (cuts[-1], high)]

    def steps(self, key: str) -> list[int]:
        """The steps of ``to_numpy(key)``'s columns (after it ran)."""
        return [int(s) for s in self._steps[key]]

    def to_pandas(self) -> pandas.DataFrame:
        """Every value as a long frame: step, rank, key, value, weight, time, event_id (the rows in the
        order iterating gives them), made page by page from the pages' arrays, read ahead."""
        import numpy as np
        import pandas as pd

        frames = []
        for page in self.pages_ahead():
            k = len(page.keys)
            bits = np.unpackbits(np.frombuffer(page.present, np.uint8), count=page.count * k).astype(bool)
            event, key = np.divmod(np.flatnonzero(bits), k)
            columns = {
                "step": np.asarray(page.step, np.int64)[event],
                "rank": np.asarray(page.rank, np.int64)[event],
                "key": np.asarray(page.keys, object)[key] if k else np.zeros(0, object),
                "value": np.frombuffer(page.values, np.float64)[bits],
                "weight": np.frombuffer(page.weight, np.float64)[event],
                "time": np.frombuffer(page.time, np.float64)[event],
                "event_id": np.asarray(page.event_id, object)[event] if page.count else np.zeros(0, object),
            }
            frames.append(pd.DataFrame(columns))
        if not frames:
            return pd.DataFrame({name: [] for name in Row._fields})
        return pd.concat(frames, ignore_index=True)


@dataclass
class Page:
    """One page decoded: the events' fields by position, their weights, times and values (events x
    keys, row by row) as float64 arrays, and which cells hold a value."""

    keys: list[str]
    count: int
    event_id: list[str]
    step: list[int]
    rank: list[int]
    world_size: list[int]
    local_rank: list[int | None]
    weight: array[float]
    time: array[float]
    values: array[float]
    present: bytes

    @classmethod
    def of(cls, document: dict[str, Any]) -> Page:
        e = document["events"]

        def floats(text: str) -> array[float]:
            numbers = array("d", base64.b64decode(text))
            if sys.byteorder == "big":
                numbers.byteswap()
            return numbers

        return cls(
            document["keys"],
            e["count"],
            e["event_id"],
            e["step"],
            e["rank"],
            e["world_size"],
            e["local_rank"],
            floats(e["weight"]),
            floats(e["time"]),
            floats(e["values"]),
            base64.b64decode(e["present"]),
        )

    def cells(self) -> Iterator[tuple[int, int, float]]:
        """(event, key, value) of every cell that holds a value, event by event."""
        k, present, values = len(self.keys), self.present, self.values
        for cell in range(self.count * k):
            if present[cell >> 3] & (128 >> (cell & 7)):
                yield cell // k, cell % k, values[cell]

    def metrics(self) -> Iterator[tuple[int, dict[str, float | str]]]:
        """Each event with its metrics as logged (NaN and Infinity as the contract's strings)."""
        k, keys, present, values = len(self.keys), self.keys, self.present, self.values
        for i in range(self.count):
            found: dict[str, float | str] = {}
            for j in range(k):
                cell = i * k + j
                if present[cell >> 3] & (128 >> (cell & 7)):
                    found[keys[j]] = limits.wire_value(values[cell])
            yield i, found
