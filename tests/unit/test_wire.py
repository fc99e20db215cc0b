"""The summary on the wire (``shared.summary.wire``): the base64 heatmap carries exactly the lists' values,
and a refresh with ``since`` gives, applied as the contract's readers apply it, the document a full GET
gives, whatever changed."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from shared import stats
from shared.store.port import StoredEvent
from shared.summary import wire
from shared.summary.decoding import decode
from shared.summary.document import Summary, summarize
from shared.summary.query import SummaryQuery, parse_query
from tests.synthetic import synthetic_job


def _summary(events: list[StoredEvent], query: SummaryQuery) -> Summary:
    return summarize(decode(events), "p", "r", query, arrays=True)


def _get(events: list[StoredEvent], query: SummaryQuery) -> dict[str, Any]:
    """A GET's answer as a reader receives it (a JSON round trip)."""
    import json

    return json.loads(json.dumps(wire.answer(_summary(events, query), query)))  # type: ignore[no-any-return]


def _apply(old: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """What a reader does with an answer to ``since`` (the spec in ``shared.summary.wire``)."""
    if answer.get("unchanged"):
        return {**old, "version": answer["version"]}
    if "since" not in answer:
        return answer
    start = answer["from_column"]
    new = {**old, **{k: v for k, v in answer.items() if k not in ("since", "from_column")}}
    new["steps"] = old["steps"][:start] + answer["steps"]
    new["reducers"] = {
        key: {name: old["reducers"][key][name][:start] + values for name, values in reducers.items()}
        for key, reducers in answer["reducers"].items()
    }
    new["coverage"] = {name: old["coverage"][name][:start] + v for name, v in answer["coverage"].items()}
    if "heatmap" in answer:
        if old["heatmap_encoding"] == "base64":
            rows = len(new["ranks"])
            new["heatmap"] = {
                key: {
                    "values": wire.encode_matrix(
                        np.hstack(
                            [
                                wire.decode_matrix(old["heatmap"][key]["values"], rows)[:, :start],
                                wire.decode_matrix(cells["values"], rows),
                            ]
                        )
                    )
                }
                for key, cells in answer["heatmap"].items()
            }
        else:
            new["heatmap"] = {
                key: {
                    name: [a[:start] + b for a, b in zip(old["heatmap"][key][name], rows, strict=True)]
                    for name, rows in cells.items()
                }
                for key, cells in answer["heatmap"].items()
            }
    return new


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    def nan_safe(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        if isinstance(value, dict):
            return {k: nan_safe(v) for k, v in value.items()}
        if isinstance(value, list):
            return [nan_safe(v) for v in value]
        return value

    assert nan_safe(a) == nan_safe(b)


def test_base64_carries_every_value_of_the_lists_and_z_follows_from_the_reducers() -> None:
    events = synthetic_job(8, 40, faults=("nan", "stop"), keys=3)
    lists = _get(events, parse_query({"heatmap": "lists"}))
    packed = _get(events, parse_query({"heatmap": "base64"}))
    assert (lists["heatmap_encoding"], packed["heatmap_encoding"]) == ("lists", "base64")
    assert "z" not in packed["heatmap"]["train/loss"]
    for key in lists["keys"]:
        matrix = wire.decode_matrix(packed["heatmap"][key]["values"], len(packed["ranks"]))
        expected = np.array(lists["heatmap"][key]["values"], dtype=float)  # null -> NaN
        assert np.array_equal(matrix, expected, equal_nan=True)  # bit for bit, NaN where null
        mean = np.array(packed["reducers"][key]["mean"], dtype=float)
        std = np.array(packed["reducers"][key]["std"], dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            z = np.where(std > stats.ROUNDING * np.abs(mean), (matrix - mean) / std, 0.0)
        z[np.isnan(matrix)] = np.nan
        assert np.allclose(z, np.array(lists["heatmap"][key]["z"], dtype=float), atol=1e-3, equal_nan=True)
    assert {k: v for k, v in packed.items() if k not in ("heatmap", "heatmap_encoding", "version")} == {
        k: v for k, v in lists.items() if k not in ("heatmap", "heatmap_encoding", "version")
    }


def test_auto_keeps_lists_for_small_runs_and_base64_past_the_cell_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = synthetic_job(4, 30, keys=2)
    assert _get(events, SummaryQuery())["heatmap_encoding"] == "lists"
    monkeypatch.setattr(wire, "AUTO_LIST_CELLS", 4 * 30 * 2 - 1)
    assert _get(events, SummaryQuery())["heatmap_encoding"] == "base64"


def test_none_leaves_out_the_heatmap_and_the_outliers() -> None:
    document = _get(synthetic_job(8, 30, faults=("spikes",)), parse_query({"heatmap": "none"}))
    assert "heatmap" not in document
    assert "outliers" not in document
    assert document["findings"]
    assert document["reducers"]


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["lists", "base64", "none"])
def test_a_refresh_applied_is_the_whole_document_whatever_changed(encoding: str) -> None:
    ranks, steps = 6, 300
    job = synthetic_job(ranks, steps, faults=("spikes", "stop"), keys=3)
    query = parse_query({"heatmap": encoding, "max_steps": "100"})  # 2 steps a column
    rng = np.random.default_rng(7)

    def later(events: list[StoredEvent], step: int) -> list[StoredEvent]:
        """Events as they are after a late event replaced rank 0's value at ``step``."""
        out = list(events)
        i = next(i for i, e in enumerate(out) if e.step == step and e.rank == 0)
        packed = np.frombuffer(out[i].packed, "<f8").copy()
        packed[1] += 1.0  # a later time wins (contract 6)
        packed[2] = rng.normal(5, 1)
        out[i] = out[i]._replace(event_id=out[i].event_id + "x", packed=packed.tobytes())
        return [*out, events[i]]

    grown = [e for e in job if e.step < 200]  # 100 columns
    base = [e for e in grown if e.step < 190]
    cases = {
        "nothing": (base, base, "unchanged"),
        "a new step in the last column": (base, [e for e in grown if e.step < 191], "delta"),
        "new columns": (base, grown, "delta"),
        "a late value in a recent column": (grown, later(grown, 190), "delta"),
        "a late value in an early column": (grown, later(grown, 3), "whole"),
        "another grid (the bin size grows)": (grown, job, "whole"),  # 3 steps a column
    }
    for name, (before, after, kind) in cases.items():
        old = _get(before, query)
        answer = _get(after, replace(query, since=old["version"]))
        full = _get(after, query)
        got = "unchanged" if answer.get("unchanged") else "delta" if "since" in answer else "whole"
        assert got == kind, name
        _same(_apply(copy.deepcopy(old), answer), full)
        if kind == "delta":
            assert answer["from_column"] >= len(old["steps"]) - wire.TAIL_COLUMNS, name


def test_a_version_this_server_does_not_write_gets_the_whole_document() -> None:
    events = synthetic_job(4, 20, keys=2)
    for since in ("AAAA", "x" * 40, "Ab-_" * 10):
        document = _get(events, parse_query({"since": since}))
        assert "since" not in document
        assert "unchanged" not in document
        assert document["steps"]


@pytest.mark.slow
def test_the_default_answer_for_512_ranks_fits_a_lambda_response_without_compression() -> None:
    import json

    events = synthetic_job(512, 200, keys=3)  # 512 x 200 columns x 3 keys: 307,200 cells
    answer = wire.answer(_summary(events, SummaryQuery()), SummaryQuery())
    body = json.dumps(answer, separators=(",", ":")).encode()
    assert answer["heatmap_encoding"] == "base64"
    assert len(body) < 6_000_000, len(body)
    lists = wire.answer(
        _summary(events, parse_query({"heatmap": "lists"})), parse_query({"heatmap": "lists"})
    )
    assert len(json.dumps(lists, separators=(",", ":"))) > 2 * len(body)  # what base64 saves
