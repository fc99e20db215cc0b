"""The csv export's pages, written by Python's lines and by Arrow's csv writer (with pyarrow installed):
both read back bit for bit with the csv module, NaN and Infinity as the contract's strings, missing cells
left out, and a key or an event id with a comma or a quote quoted."""

from __future__ import annotations

import csv
import io
import math
import struct
from array import array

import pytest

from instantml import limits
from instantml.api import Page
from instantml.commands import export

SPECIAL = [math.nan, math.inf, -math.inf, 5e-324, -0.0, 0.1 + 0.2, 1.7976931348623157e308, 100.0, 1e-7, 2.5]


def bits(x: float) -> bytes:
    """The float's bits; any NaN as one (the contract has one NaN: its sign is not kept)."""
    return b"NaN" if math.isnan(x) else struct.pack("<d", x)


def page(keys: list[str], ids: list[str]) -> Page:
    """Events of two keys: event i holds SPECIAL[i] under the first key and, when i is even, its
    negation under the second; weights and times are special too."""
    n, k = len(ids), len(keys)
    values = array("d", [0.0] * (n * k))
    present = bytearray((n * k + 7) // 8)
    for i in range(n):
        for j, x in enumerate((SPECIAL[i], -SPECIAL[i])):
            if j == 0 or i % 2 == 0:
                values[i * k + j] = x
                present[(i * k + j) >> 3] |= 128 >> ((i * k + j) & 7)
    weights = array("d", SPECIAL[::-1][:n])
    times = array("d", [1.7e9 + i / 7 for i in range(n)])
    return Page(
        keys, n, ids, list(range(n)), [3] * n, [8] * n, [None] * n, weights, times, values, bytes(present)
    )


def written(writer: str, p: Page) -> list[list[str]]:
    out = io.BytesIO()
    if writer == "lines":
        count = export._write_lines(p, out)
    else:
        arrow = export._ArrowCsv.made()
        if arrow is None:
            pytest.skip("pyarrow is not installed here")
        count = arrow.write(p, out)
    rows = list(csv.reader(io.StringIO(out.getvalue().decode(), newline="")))
    assert count == len(rows) and out.getvalue().endswith(b"\r\n")
    return rows


def number(text: str) -> float:
    return limits.NONFINITE_STRINGS[text] if text in limits.NONFINITE_STRINGS else float(text)


@pytest.mark.parametrize("writer", ["lines", "arrow"])
@pytest.mark.parametrize("awkward", [False, True])
def test_a_page_reads_back_bit_for_bit_cell_by_cell(writer: str, awkward: bool) -> None:
    keys = ['a "quoted", key', "train/loss"] if awkward else ["train/grad", "train/loss"]
    ids = [f"id-{i}" + (",x" if awkward and i == 3 else "") for i in range(len(SPECIAL))]
    p = page(keys, ids)
    rows = written(writer, p)
    expected = [
        (i, keys[j], x)
        for i in range(len(ids))
        for j, x in enumerate((SPECIAL[i], -SPECIAL[i]))
        if j == 0 or i % 2 == 0
    ]
    assert [(int(r[0]), r[2]) for r in rows] == [(i, key) for i, key, _ in expected]
    assert [bits(number(r[3])) for r in rows] == [bits(x) for _, _, x in expected]
    assert [bits(number(r[4])) for r in rows] == [bits(p.weight[i]) for i, _, _ in expected]
    assert [bits(number(r[5])) for r in rows] == [bits(p.time[i]) for i, _, _ in expected]
    assert [r[6] for r in rows] == [ids[i] for i, _, _ in expected]
    assert {r[1] for r in rows} == {"3"}
    texts = {r[3] for r in rows}
    assert {"NaN", "Infinity", "-Infinity"} <= texts and not {"nan", "inf", "-inf"} & texts
