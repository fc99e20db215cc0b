"""``instantml export`` and ``instantml runs`` (contract 9): a run's stored values out to a file, or a
spool that ``instantml sync --api-url OTHER`` replays into another server with the original event ids;
a project's runs in the terminal.

Export streams: it holds one page of the server's answer at a time (``instantml.api``), whatever the
run's length, and draws a progress bar on stderr by the steps done of the run's last step.

- ``csv``: one row per value, ``step,rank,key,value,weight,time,event_id`` (each value in the
  shortest text that reads back bit for bit: ``repr``'s, or Arrow's with pyarrow installed; NaN and
  Infinity as ``NaN``, ``Infinity``, ``-Infinity``);
- ``jsonl``: one stored event per line, its metrics as logged (NaN and Infinity as the contract's strings);
- ``parquet``: the csv's columns, typed, one row group per page, ordered key by key within it (pyarrow:
  ``pip install pyarrow``);
- ``spool``: a spool directory (contract 4): the run's config, its rank events and its ``run.log``
  scalars as the request events a training process would have written, with their ids.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from instantml import limits, routes
from instantml.api import Api, ApiError, Page, Values

FORMATS = ("csv", "jsonl", "parquet", "spool")
COLUMNS = ("step", "rank", "key", "value", "weight", "time", "event_id")
EVENT_FIELDS = ("event_id", "step", "rank", "world_size", "local_rank", "weight", "time")


def add_parsers(commands: Any, add_connection_arguments: Any) -> None:
    export = commands.add_parser(
        "export",
        help="write a run's stored values to csv, jsonl, parquet, or a spool another server can sync",
        description="Every stored rank value of a run, at full resolution, streamed to a file. "
        "--format spool writes a spool directory: `instantml sync DIR --api-url OTHER` moves the run "
        "(config, rank events, run.log scalars, the same event ids) to another server.",
    )
    export.add_argument("--project", required=True)
    export.add_argument("run_id", metavar="RUN")
    export.add_argument("--keys", help="comma-separated keys (default: every key)")
    export.add_argument("--format", choices=FORMATS, default="csv", help="default: csv")
    export.add_argument("-o", "--output", help="file (or directory, for spool); default: RUN.FORMAT")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    add_connection_arguments(export)
    listing = commands.add_parser(
        "runs", help="list a project's runs: status, world size, step, findings, processes by state"
    )
    listing.add_argument("--project", required=True)
    listing.add_argument("--status", choices=("live", "idle", "finished"))
    add_connection_arguments(listing)


def command(args: argparse.Namespace) -> int:
    """Exit 0 when done, 2 on a usage or connection error (said on stderr)."""
    try:
        api = Api(args.api_url, args.api_key)
        if args.command == "runs":
            return list_runs(api, args.project, args.status, sys.stdout)
        return export(api, args)
    except ApiError as exc:
        print(f"instantml {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"instantml {args.command}: {exc}", file=sys.stderr)
        return 2


def list_runs(api: Api, project: str, status: str | None, out: IO[str]) -> int:
    rows = [("RUN", "STATUS", "WORLD", "LAST STEP", "CRIT/WARN/INFO", "PROCESSES", "HEADLINE")]
    for info in api.runs(project, status):
        counts = info.findings or {}
        findings = "/".join(str(counts.get(s, 0)) for s in ("critical", "warning", "info"))
        last = "" if info.last_step is None else str(info.last_step)
        world = "" if info.world_size is None else str(info.world_size)
        headline = str(info.record.get("headline") or "")
        processes = ", ".join(f"{n} {state}" for state, n in (info.process_states or {}).items())
        rows.append((info.run_id, info.status, world, last, findings, processes, headline))
    if len(rows) == 1:
        print(f"{project}: no runs", file=out)
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1], file=out)
    return 0


class Progress:
    """Steps done of the run's last step, on stderr (redrawn in place on a terminal)."""

    def __init__(self, last_step: int | None, quiet: bool) -> None:
        self.last_step, self.quiet = last_step or 0, quiet
        self.values, self.started, self.drawn = 0, time.monotonic(), 0.0
        self.tty = sys.stderr.isatty()

    def page(self, page: Page) -> None:
        self.values += int.from_bytes(page.present, "big").bit_count()
        now = time.monotonic()
        if self.quiet or now - self.drawn < (0.1 if self.tty else 5.0):
            return
        self.drawn = now
        self._draw(page.step[-1] if page.count else self.last_step)

    def _draw(self, step: int) -> None:
        share = 1.0 if self.last_step == 0 else min(1.0, step / self.last_step)
        rate = self.values / max(time.monotonic() - self.started, 1e-9)
        bar = "#" * int(24 * share)
        text = f"[{bar:.<24}] step {step:,} of {self.last_step:,}  {self.values:,} values  {rate:,.0f}/s"
        sys.stderr.write(("\r" + text + "\033[K") if self.tty else text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if not self.quiet:
            self._draw(self.last_step)
            if self.tty:
                sys.stderr.write("\n")


def export(api: Api, args: argparse.Namespace) -> int:
    run = api.run(args.project, args.run_id)
    keys = [k for k in args.keys.split(",") if k] if args.keys else None
    values = run.rank_metrics(keys=keys)
    target = Path(args.output or f"{args.run_id}.{args.format}")
    progress = Progress(run.record.get("last_step"), args.quiet)
    writers = {"csv": _csv, "jsonl": _jsonl, "parquet": _parquet, "spool": _spool}
    count = writers[args.format](values, target, progress, run)
    progress.done()
    print(f"instantml export: {count:,} values of {args.project}/{args.run_id} written to {target}")
    return 0


def _text(value: float) -> str:
    return repr(value) if -math.inf < value < math.inf else str(limits.wire_value(value))


def _pages(values: Values, progress: Progress) -> Iterator[Page]:
    for page in values.pages_ahead():
        progress.page(page)
        yield page


def _csv(values: Values, target: Path, progress: Progress, _: Any) -> int:
    """With pyarrow installed, each page is made a table and written by Arrow's csv writer (its floats'
    texts the shortest that read back bit for bit, as ``repr``'s, but ``100`` for ``100.0``); without,
    lines are made as text (no csv module per row). Either way a key or an event id with a comma, a
    quote or a line break in it is quoted, as the csv module would."""
    count = 0
    write: Callable[[Page, IO[bytes]], int] | None = None
    with open(target, "wb") as f:
        f.write((",".join(COLUMNS) + "\r\n").encode())
        for page in _pages(values, progress):
            if write is None:  # (once the reads run: pyarrow is imported while they go on)
                arrow = _ArrowCsv.made()
                write = arrow.write if arrow else _write_lines
            count += write(page, f)
    return count


def _write_lines(page: Page, f: IO[bytes]) -> int:
    """A page as csv lines made in Python: column by column, each made by one ``map`` and joined once,
    when every event holds every key (the usual page); cell by cell otherwise."""
    keys = [_quoted(k) + "," for k in page.keys]
    heads = [f"{s},{r}," for s, r in zip(page.step, page.rank, strict=True)]
    ids = page.event_id
    if _NEEDS_QUOTES.search("".join(ids)):
        ids = [_quoted(i) for i in ids]
    tails = [f",{w},{t},{i}\r\n" for w, t, i in zip(_texts(page.weight), _texts(page.time), ids, strict=True)]
    k, cells = len(keys), page.count * len(keys)
    if cells and int.from_bytes(page.present, "big").bit_count() == cells:
        values_text = _texts(page.values)
        columns = []
        for j, key in enumerate(keys):
            columns += [heads, itertools.repeat(key), values_text[j::k], tails]
        rows = zip(*columns, strict=False)  # (the keys repeat without end)
        f.write("".join(itertools.chain.from_iterable(rows)).encode())
        return cells
    lines = [heads[i] + keys[j] + _text(v) + tails[i] for i, j, v in page.cells()]
    f.write("".join(lines).encode())
    return len(lines)


_NEEDS_QUOTES = re.compile('[,"\r\n]')


def _texts(numbers: Any) -> list[str]:
    """``_text`` of each float of an array, made by ``map`` (``repr``, then NaN and Infinity fixed)."""
    texts = list(map(repr, numbers))
    if False in map(math.isfinite, numbers):
        for i, x in enumerate(numbers):
            if not math.isfinite(x):
                texts[i] = _text(x)
    return texts


def _page_columns(page: Page) -> list[Any]:
    """A page's cells that hold a value, one row each, as the columns of ``COLUMNS`` (numpy arrays and
    Arrow arrays): for the parquet and the csv writers, with pyarrow installed."""
    import numpy as np
    import pyarrow as pa

    k = len(page.keys)
    bits = np.unpackbits(np.frombuffer(page.present, np.uint8), count=page.count * k).astype(bool)
    event, key = np.divmod(np.flatnonzero(bits), k)
    return [
        np.asarray(page.step, np.int64)[event],
        np.asarray(page.rank, np.int32)[event],
        pa.DictionaryArray.from_arrays(pa.array(key.astype(np.int32)), pa.array(page.keys)).cast(pa.string()),
        np.frombuffer(page.values, np.float64)[bits],  # (the page's arrays are in native order)
        np.frombuffer(page.weight, np.float64)[event],
        np.frombuffer(page.time, np.float64)[event],
        pa.array(page.event_id).take(pa.array(event)),
    ]


class _ArrowCsv:
    """Arrow's csv writer, for a page at a time: strings unquoted, unless a key or an event id of the
    page needs quotes (then every string of that page is quoted); NaN and Infinity as the contract's
    strings (Arrow would write ``nan`` and ``inf``)."""

    def __init__(self) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pa_csv

        self.np, self.pa, self.pc, self.pa_csv = np, pa, pc, pa_csv
        self.options = {
            quoted: pa_csv.WriteOptions(
                include_header=False,
                quoting_style="needed" if quoted else "none",
                eol="\r\n",
                batch_size=16384,  # (Arrow's default of 1,024 rows a batch is a fifth slower here)
            )
            for quoted in (False, True)
        }

    @classmethod
    def made(cls) -> _ArrowCsv | None:
        try:
            return cls()
        except (ImportError, TypeError):  # (none, or one older than its quoting_style and eol options)
            return None

    def write(self, page: Page, f: IO[bytes]) -> int:
        columns = _page_columns(page)
        for i in (3, 4, 5):  # value, weight, time
            columns[i] = self.texts(columns[i])
        quoted = bool(
            _NEEDS_QUOTES.search("".join(page.keys)) or _NEEDS_QUOTES.search("".join(page.event_id))
        )
        if len(columns[0]):
            table = self.pa.table(columns, names=list(COLUMNS))
            self.pa_csv.write_csv(table, f, self.options[quoted])
        return len(columns[0])

    def texts(self, column: Any) -> Any:
        """The column as it is when every float is finite (Arrow writes the shortest text that reads
        back), else as strings with NaN and Infinity written as the contract says."""
        np, pa, pc = self.np, self.pa, self.pc
        finite = np.isfinite(column)
        if finite.all():
            return column
        strings = pc.cast(pa.array(column), pa.string())
        fixed = np.where(np.isnan(column), "NaN", np.where(column > 0, "Infinity", "-Infinity"))
        return pc.if_else(pa.array(finite), strings, pa.array(fixed))


def _quoted(text: str) -> str:
    if any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _jsonl(values: Values, target: Path, progress: Progress, _: Any) -> int:
    count = 0
    with open(target, "w") as f:
        for page in _pages(values, progress):
            for i, metrics in page.metrics():
                event = _event(page, i)
                f.write(json.dumps({**event, "metrics": metrics}, separators=(",", ":")) + "\n")
                count += len(metrics)
    return count


def _event(page: Page, i: int) -> dict[str, Any]:
    fields: tuple[Any, ...] = (
        page.event_id,
        page.step,
        page.rank,
        page.world_size,
        page.local_rank,
        page.weight,
        page.time,
    )
    return {name: column[i] for name, column in zip(EVENT_FIELDS, fields, strict=True)}


def _parquet(values: Values, target: Path, progress: Progress, _: Any) -> int:
    try:
        import numpy  # noqa: F401 - (the pages' columns are made with it)
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ApiError("--format parquet needs pyarrow: pip install pyarrow (or use csv or jsonl)") from None
    types = (pa.int64(), pa.int32(), pa.string(), pa.float64(), pa.float64(), pa.float64(), pa.string())
    schema = pa.schema(list(zip(COLUMNS, types, strict=True)))
    count = 0
    with pq.ParquetWriter(target, schema) as writer:
        for page in _pages(values, progress):
            columns = _page_columns(page)
            if len(columns[0]):
                writer.write_table(pa.table(columns, schema=schema))  # one row group a page
                count += len(columns[0])
    return count


def _scalar_pages(run: Any) -> Iterator[Page]:
    """The run's ``run.log`` pages; none for a run without scalars (the route's 404)."""
    try:
        yield from run.scalars().pages()
    except ApiError as exc:
        if exc.status != 404:
            raise


def _spool(values: Values, target: Path, progress: Progress, run: Any) -> int:
    """A spool directory with one file (contract 4), replayable with ``instantml sync``."""
    from urllib.parse import quote

    target.mkdir(parents=True, exist_ok=True)
    names = {"project": quote(run.project, safe=""), "run_id": quote(run.run_id, safe="")}
    name = f"{run.project}@{run.run_id}@export@pid{os.getpid()}@rank-@{os.urandom(3).hex()}.jsonl"
    now, count = time.time(), 0
    creating = target / (name + ".creating")
    with open(creating, "w") as f:

        def line(event_id: str, method: str, path: str, body: dict[str, Any]) -> None:
            request = {"v": 1, "event_id": event_id, "method": method, "path": path, "body": body}
            f.write(json.dumps({**request, "created": now}, separators=(",", ":"), allow_nan=False) + "\n")

        if run.config is not None:
            text = json.dumps(run.config, sort_keys=True, separators=(",", ":"))
            config_id = "config-" + hashlib.sha256(text.encode()).hexdigest()[:32]  # the same for the same
            line(config_id, "PATCH", routes.RUN.format(**names), {"config": run.config})
        for page in _pages(values, progress):
            for i, metrics in page.metrics():
                event = _event(page, i)
                body = {k: event[k] for k in ("step", "rank", "world_size", "weight", "time")}
                body["metrics"] = metrics
                if event["local_rank"] is not None:
                    body["local_rank"] = event["local_rank"]
                line(event["event_id"], "POST", routes.RANK_METRICS.format(**names), body)
                count += len(metrics)
        for page in _scalar_pages(run):
            for i, metrics in page.metrics():
                body = {"step": page.step[i], "rank": page.rank[i], "time": page.time[i], "metrics": metrics}
                line(page.event_id[i], "POST", routes.SCALARS.format(**names), body)
                count += len(metrics)
    os.rename(creating, target / name)
    return count
