"""The Distributed summary on the wire: how its heatmap travels, its ``version``, and a refresh that
moves only what changed (``since``). Pure: no I/O; the summarize function applies it to the document
``shared.summary.document`` computes (heatmap as numpy matrices).

**Heatmap.** As contract 5.1's lists of lists, or as ``base64``: ``heatmap[key] = {"values": "..."}``,
the float64 little-endian matrix row by row (one row per rank, one column per step column, NaN where
the lists have ``null``), with no ``z`` (z = (value - mean) / std of the column, as contract 5.4
defines it, and 0 where std is at most ``stats.ROUNDING`` times |mean|, rounding noise as in
``stats.zscores``; the reader computes it). Full float64 precision either way; base64 is 10.7
bytes a value against about 19 for JSON numbers, and half of what ``z`` added: a 512-rank x 200-column
heatmap of 4 keys is 4.4 MB instead of 15, so the default answer fits the 6 MB a Lambda response
carries without compression. ``auto`` (the default) keeps the lists up to ``AUTO_LIST_CELLS`` cells, the
size at which they stay well under that limit, so small runs keep the contract's plain shape.

**Version and refresh.** Every document carries ``version``: a hash of its column grid (keys, world
size, bin size, first column, the query), one short hash per step column for the last
``TAIL_COLUMNS`` columns and one for all those before, and one per other part (findings, rank
statistics, outliers, the rest). A GET with ``since=<version>`` compares the hashes of the document it
has just computed with those the reader holds, and answers:

- ``{"version": v, "unchanged": true}`` when all are equal;
- a delta from the first column that changed (``from_column``): the column-aligned lists and heatmap
  columns from there on, which replace the reader's, and each other part only when it changed;
- the whole document when no delta can be made (another grid, a change before the last
  ``TAIL_COLUMNS`` columns, a version this server does not read).

Nothing is kept between requests: the version itself says what the reader has, so any worker process
or Lambda instance answers it. A live run gains columns at its end, so a refresh moves those and the
parts that changed. Two different columns share a hash with probability 2^-48.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from shared.summary.document import STATISTICS, heatmap_lists
from shared.summary.query import SummaryQuery

#: ``heatmap=auto`` sends lists up to this many cells (ranks x columns x keys): about 7.6 MB of values
#: and z as JSON at the limit would not fit; 200,000 cells are about 4 MB.
AUTO_LIST_CELLS = 200_000
#: Columns a version names one by one (the rest share one hash): a refresh of a live run changes its
#: last columns, and the version stays a few hundred bytes for any ``max_steps``.
TAIL_COLUMNS = 64
HASH_BYTES = 6
_FORMAT = 1
_HEAD = struct.Struct(f"<B{HASH_BYTES}sII{HASH_BYTES}s")  # format, grid, columns, tail columns, prefix

#: Lists aligned with ``steps`` (contract 5.1), besides ``steps`` itself and the heatmap.
REDUCER_NAMES = (*STATISTICS, "nonfinite")
COVERAGE_NAMES = ("expected", "reported", "missing")
#: The parts that are not aligned with the columns, each sent whole when it changed.
PARTS = ("findings", "rank_stats", "outliers", "meta", "processes")
META_FIELDS = (
    "project",
    "run_id",
    "keys",
    "world_size",
    "ranks",
    "step_min",
    "step_max",
    "bin_size",
    "resolution",
    "heatmap_encoding",
)


def encoding_for(summary: Mapping[str, Any], asked: str) -> str:
    """The heatmap encoding an answer uses: ``asked``, with ``auto`` resolved by size."""
    if asked != "auto":
        return asked
    cells = len(summary["ranks"]) * len(summary["steps"]) * len(summary["keys"])
    return "lists" if cells <= AUTO_LIST_CELLS else "base64"


def answer(summary: Mapping[str, Any], query: SummaryQuery) -> dict[str, Any]:
    """The JSON-ready answer to ``query`` from ``summary`` (heatmap as matrices): whole, or, when
    ``query.since`` names an earlier version, what changed since it."""
    encoding = encoding_for(summary, query.heatmap)
    summary = {**summary, "heatmap_encoding": encoding}
    grid = _grid_hash(summary, query, encoding)
    columns = column_hashes(summary)
    parts = {name: _hash(_json(_part(summary, name))) for name in PARTS}
    version = _version(grid, columns, parts)
    old = _read_version(query.since) if query.since else None
    if old is not None and old[0] == grid:
        start = _first_changed(columns, old)
        if start is not None:
            changed = [name for name in PARTS if parts[name] != old[4][PARTS.index(name)]]
            if start == old[1] == len(columns) and not changed:
                return {"version": version, "unchanged": True}
            delta: dict[str, Any] = {"version": version, "since": query.since, "from_column": start}
            delta.update(_columns_from(summary, start, encoding))
            for name in changed:
                if name == "meta":
                    delta.update({f: summary[f] for f in META_FIELDS if f in summary})
                elif name != "outliers" or encoding != "none":
                    delta[name] = summary[name]
            return delta
    document = {**summary, **_columns_from(summary, 0, encoding), "version": version}
    if encoding == "none":
        del document["heatmap"], document["outliers"]
    return document


def _columns_from(summary: Mapping[str, Any], start: int, encoding: str) -> dict[str, Any]:
    """The column-aligned parts of ``summary`` from column ``start`` on, the heatmap encoded."""
    out: dict[str, Any] = {
        "steps": summary["steps"][start:],
        "reducers": {
            key: {name: values[start:] for name, values in reducers.items()}
            for key, reducers in summary["reducers"].items()
        },
        "coverage": {name: values[start:] for name, values in summary["coverage"].items()},
    }
    heatmap = summary["heatmap"]
    if encoding == "lists":
        out["heatmap"] = heatmap_lists(
            {key: {name: m[:, start:] for name, m in cells.items()} for key, cells in heatmap.items()}
        )
    elif encoding == "base64":
        out["heatmap"] = {
            key: {"values": encode_matrix(cells["values"][:, start:])} for key, cells in heatmap.items()
        }
    return out


def encode_matrix(matrix: NDArray[np.float64]) -> str:
    """A matrix as base64 of its float64 little-endian values, row by row."""
    return base64.b64encode(np.ascontiguousarray(matrix, "<f8").tobytes()).decode("ascii")


def decode_matrix(text: str, rows: int) -> NDArray[np.float64]:
    """The inverse of :func:`encode_matrix` (for readers in Python and for tests)."""
    flat = np.frombuffer(base64.b64decode(text), "<f8")
    return flat.reshape(rows, -1 if rows else 0) if rows else flat.reshape(0, 0)


def column_hashes(summary: Mapping[str, Any]) -> list[bytes]:
    """One short hash per step column, over everything aligned with it (z follows from those)."""
    keys = list(summary["reducers"])
    rows: list[list[Any]] = [summary["steps"]]
    rows += [summary["reducers"][key][name] for key in keys for name in REDUCER_NAMES]
    rows += [summary["coverage"][name] for name in COVERAGE_NAMES]
    by_column = [np.ascontiguousarray(summary["heatmap"][key]["values"].T, "<f8") for key in keys]
    hashes = []
    for c, column in enumerate(zip(*rows, strict=True)):
        h = hashlib.blake2b(_json(column), digest_size=HASH_BYTES)
        for matrix in by_column:
            h.update(matrix[c].tobytes())
        hashes.append(h.digest())
    return hashes


def _part(summary: Mapping[str, Any], name: str) -> Any:
    if name == "meta":
        return [summary.get(field) for field in META_FIELDS]
    return summary.get(name)


def _grid_hash(summary: Mapping[str, Any], query: SummaryQuery, encoding: str) -> bytes:
    grid = [
        summary["keys"],
        summary["world_size"],
        summary["bin_size"],
        summary["steps"][:1],
        encoding,
        [query.keys, query.step_min, query.step_max, query.max_steps],
        [query.outlier_method, query.outlier_threshold, query.outlier_limit],
    ]
    return _hash(_json(grid))


def _version(grid: bytes, columns: list[bytes], parts: dict[str, bytes]) -> str:
    tail = min(TAIL_COLUMNS, len(columns))
    prefix = _hash(b"".join(columns[: len(columns) - tail]))
    head = _HEAD.pack(_FORMAT, grid, len(columns), tail, prefix)
    raw = head + b"".join(columns[len(columns) - tail :]) + b"".join(parts[name] for name in PARTS)
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


_Version = tuple[bytes, int, bytes, list[bytes], list[bytes]]  # grid, columns, prefix, tail, parts


def _read_version(text: str) -> _Version | None:
    """A version's fields, or None when it is not one this server writes (then the answer is whole)."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        fmt, grid, n, tail, prefix = _HEAD.unpack_from(raw)
    except (binascii.Error, ValueError, struct.error):
        return None
    if fmt != _FORMAT or tail > n or len(raw) != _HEAD.size + (tail + len(PARTS)) * HASH_BYTES:
        return None
    hashes = _split(raw[_HEAD.size :], tail + len(PARTS))
    return grid, n, prefix, hashes[:tail], hashes[tail:]


def _first_changed(columns: list[bytes], old: _Version) -> int | None:
    """The first column that differs from the reader's, or None when that cannot be told (a change
    among the columns its version names by one hash only)."""
    _, n_old, prefix, tail, _ = old
    named_from = n_old - len(tail)
    if len(columns) < named_from or _hash(b"".join(columns[:named_from])) != prefix:
        return None
    for c in range(named_from, min(n_old, len(columns))):
        if columns[c] != tail[c - named_from]:
            return c
    return min(n_old, len(columns))


def _split(raw: bytes, count: int) -> list[bytes]:
    return [raw[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=_plain).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Iterable):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")
