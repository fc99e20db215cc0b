"""Reading back at full resolution (contract 9) on the real local stack over HTTP, with the real client:
``GET .../rank-metrics`` and ``GET .../scalars?raw=1`` page by page, ``im.Api`` (runs, a run's record,
its values streamed, ``to_numpy``), ``instantml export`` (csv, jsonl, spool) and ``instantml runs`` as
processes, and a run moved to a second stack on another data directory with ``export --format spool``
and ``instantml sync``: every value bit for bit, the same summary, and its own replay all duplicates."""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import instantml as im
from instantml import limits, routes
from instantml.api import READ_WINDOWS, ApiError
from tests.faults import call

PROJECT, RUN, WORLD, STEPS = "reading", "r1", 8, 30
KEYS = ("train/loss", "optimizer/grad_norm", "odd key, with comma")
SPECIAL = [math.nan, math.inf, -math.inf, 5e-324, 0.1 + 0.2, -0.0, 1.7976931348623157e308, 2.0**-1074 * 3]


def value(step: int, rank: int, key: int, rng: random.Random) -> float:
    if (step + rank + key) % 11 == 0:
        return SPECIAL[(step * 3 + rank + key) % len(SPECIAL)]
    return float(struct.unpack("<d", struct.pack("<Q", rng.getrandbits(62)))[0])  # any finite bits


def logged() -> dict[tuple[int, int, str], float]:
    rng = random.Random(7)
    return {
        (step, rank, key): value(step, rank, k, rng)
        for step in range(STEPS)
        for rank in range(WORLD)
        if not (rank == 5 and step >= 20)  # rank 5 stops at step 20
        for k, key in enumerate(KEYS)
    }


def wire(x: float) -> float | str:
    return (
        "NaN" if math.isnan(x) else ("Infinity" if x == math.inf else ("-Infinity" if x == -math.inf else x))
    )


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def seed(stack: Any, project: str = PROJECT, run_id: str = RUN) -> None:
    values = logged()
    events = []
    for step in range(STEPS):
        for rank in range(WORLD):
            metrics = {key: wire(values[(step, rank, key)]) for key in KEYS if (step, rank, key) in values}
            if metrics:
                events.append(
                    {
                        "event_id": f"{run_id}-{step}-{rank}",
                        "step": step,
                        "rank": rank,
                        "world_size": WORLD,
                        "local_rank": rank % 4,
                        "weight": 1.0 + rank,
                        "time": 1_764_672_000.125 + step + rank / 1000,
                        "metrics": metrics,
                    }
                )
    path = routes.RANK_METRICS_BATCH.format(project=project, run_id=run_id)
    for start in range(0, len(events), 100):
        status, answer = call(stack, "POST", path, {"events": events[start : start + 100]})
        assert status == 200 and answer["rejected"] == 0, answer
    scalars = [
        {
            "event_id": f"s{n}",
            "step": n,
            "time": 1_764_672_000.5 + n,
            "metrics": {"lr": 3e-4 * n, "eval/acc": wire(SPECIAL[n % 8])},
        }
        for n in range(25)
    ]
    status, _ = call(
        stack, "POST", routes.SCALARS_BATCH.format(project=project, run_id=run_id), {"events": scalars}
    )
    assert status == 200
    status, _ = call(
        stack, "PATCH", routes.RUN.format(project=project, run_id=run_id), {"config": {"lr": 3e-4, "seed": 7}}
    )
    assert status == 200


@pytest.fixture(scope="module")
def stack(local_stack: Any) -> Any:
    seed(local_stack)
    return local_stack


def test_every_value_comes_back_bit_for_bit_in_step_and_rank_order(stack: Any) -> None:
    api = im.Api(stack.url, stack.token)
    rows = list(api.run(PROJECT, RUN).rank_metrics())
    expected = logged()
    assert len(rows) == len(expected)
    assert [(r.step, r.rank) for r in rows] == sorted((r.step, r.rank) for r in rows)
    for row in rows:
        assert bits(row.value) == bits(expected[(row.step, row.rank, row.key)]), row
        assert row.weight == 1.0 + row.rank and row.event_id == f"{RUN}-{row.step}-{row.rank}"


@pytest.mark.parametrize("limit", [1, 7, 8, 9, 1000])
def json_pages(stack: Any, params: dict[str, str]) -> list[dict[str, Any]]:
    """Every page of the route as JSON (its default encoding), over HTTP, following next_cursor."""
    from urllib.parse import urlencode

    pages: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = urlencode({**params, **({"cursor": cursor} if cursor else {})})
        status, page = call(
            stack, "GET", routes.RANK_METRICS.format(project=PROJECT, run_id=RUN) + "?" + query
        )
        assert status == 200, page
        pages.append(page)
        cursor = page["next_cursor"]
        if cursor is None:
            return pages


@pytest.mark.parametrize("limit", [1, 7, 8, 9, 1000])
@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_pages_of_any_size_give_the_same_values_and_end_with_a_null_cursor(
    stack: Any, limit: int, encoding: str
) -> None:
    expected = logged()
    want = [
        (s, r, expected[(s, r, "train/loss")])
        for s in range(STEPS)
        for r in (0, 5, 7)
        if (s, r, "train/loss") in expected
    ]
    if encoding == "json":
        pages = json_pages(stack, {"keys": "train/loss", "ranks": "0,5,7", "limit": str(limit)})
        assert all(p["next_cursor"] for p in pages[:-1])
        got = [(e["step"], e["rank"], e["values"][0]) for p in pages for e in p["events"]]
        got = [(s, r, limits.NONFINITE_STRINGS[v] if isinstance(v, str) else v) for s, r, v in got]
    else:
        values = (
            im.Api(stack.url, stack.token)
            .run(PROJECT, RUN)
            .rank_metrics(keys=["train/loss"], ranks=[0, 5, 7])
        )
        got = [
            (page.step[i], page.rank[i], v) for page in values.pages(limit=limit) for i, _, v in page.cells()
        ]
    assert [(s, r) for s, r, _ in got] == [(s, r) for s, r, _ in want]
    assert all(bits(v) == bits(x) for (_, _, v), (_, _, x) in zip(got, want, strict=True))


def test_pages_read_ahead_in_windows_come_in_the_order_of_pages_and_a_failure_is_raised(stack: Any) -> None:
    run = im.Api(stack.url, stack.token).run(PROJECT, RUN)

    def cells(pages: Iterator[Any]) -> list[tuple[int, int, str, bytes]]:
        return [(p.step[i], p.rank[i], p.keys[j], bits(v)) for p in pages for i, j, v in p.cells()]

    values = run.rank_metrics(step_min=3)
    assert len(values._windows(4)) == 4  # the read is cut in step windows indeed
    one_by_one = cells(values.pages(limit=7))
    assert cells(values.pages_ahead(parts=4, limit=7)) == one_by_one and len(one_by_one) > 100
    # after the first page, the rest is read as windows of the steps a page holds, the last one open
    windows = values._windows_after(next(values.pages(limit=7)))
    assert len(windows) > 4 and windows[0][0] == 3 and windows[-1][1] is None
    assert all(a[1] is not None and a[1] + 1 == b[0] for a, b in itertools.pairwise(windows))
    record = run.record
    run.record = {**record, "last_step": limits.MAX_STEP}  # a last step at the end of the range
    sparse = run.rank_metrics(step_min=3)
    assert len(sparse._windows_after(next(sparse.pages(limit=7)))) <= READ_WINDOWS  # not 2**53
    run.record = record
    narrow = run.rank_metrics(keys=["train/loss"], ranks=[1, 2], step_min=5, step_max=30)
    assert cells(narrow.pages_ahead(parts=2, limit=3)) == cells(narrow.pages(limit=3))
    first = next(values.pages_ahead(parts=3))  # a reader that stops early leaves nothing running
    assert first.count > 0
    gone = im.Api(stack.url, stack.token).run(PROJECT, RUN)
    gone._paths = {k: v.replace(RUN, "no-such-run") for k, v in gone._paths.items()}
    with pytest.raises(ApiError, match="not found"):
        list(gone.rank_metrics().pages_ahead())


def test_to_numpy_is_ranks_by_steps_with_nan_where_a_rank_did_not_report(stack: Any) -> None:
    values = im.Api(stack.url, stack.token).run(PROJECT, RUN).rank_metrics(step_min=10, step_max=24)
    matrix = values.to_numpy("optimizer/grad_norm")
    assert matrix.shape == (WORLD, 15) and values.steps("optimizer/grad_norm") == list(range(10, 25))
    expected = logged()
    for rank in range(WORLD):
        for column, step in enumerate(range(10, 25)):
            want = expected.get((step, rank, "optimizer/grad_norm"), math.nan)
            assert bits(matrix[rank, column]) == bits(want) or (
                math.isnan(want) and math.isnan(matrix[rank, column])
            )
    assert all(math.isnan(x) for x in matrix[5, 10:])  # rank 5 stopped at step 20


def test_runs_records_and_scalars_read_back(stack: Any) -> None:
    api = im.Api(stack.url, stack.token)
    assert RUN in {info.run_id for info in api.runs(PROJECT)}
    run = api.run(PROJECT, RUN)
    assert run.config == {"lr": 3e-4, "seed": 7} and run.record["world_size"] == WORLD
    lr = [r for r in run.scalars(keys=["lr"]) if r.key == "lr"]
    assert [(r.step, r.value) for r in lr] == [(n, 3e-4 * n) for n in range(25)]
    accuracy = [r.value for r in run.scalars(keys=["eval/acc"])]
    assert [bits(v) for v in accuracy] == [bits(SPECIAL[n % 8]) for n in range(25)]
    assert run.summary(keys=["train/loss"])["ranks"] == list(range(WORLD))


def test_errors_say_what_to_do(stack: Any) -> None:
    from shared.store import open_token_store

    other, _ = open_token_store(stack.store_url).create("someone-else", "reading test")
    with pytest.raises(ApiError, match="does not grant that project") as refused:
        im.Api(stack.url, other).run(PROJECT, RUN)
    assert refused.value.status == 403
    status, _ = call(stack, "GET", routes.RANK_METRICS.format(project=PROJECT, run_id=RUN), token=other)
    assert status == 403
    with pytest.raises(ApiError, match="token was refused"):
        im.Api(stack.url, "iml_nope_nope").run(PROJECT, RUN)
    with pytest.raises(ApiError, match="not found"):
        list(im.Api(stack.url, stack.token).run(PROJECT, "no-such-run").rank_metrics())
    status, answer = call(
        stack, "GET", routes.RANK_METRICS.format(project=PROJECT, run_id=RUN) + "?ranks=9999&cursor=x!"
    )
    assert status == 400 and {d["field"] for d in answer["error"]["details"]} == {"ranks", "cursor"}


def cli(
    stack: Any, *args: str, cwd: Path | None = None, api_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        "INSTANTML_API_URL": api_url or stack.url,
        "INSTANTML_API_KEY": stack.token,
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        [sys.executable, "-m", "instantml.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_csv_and_jsonl_and_runs_in_the_terminal(stack: Any, tmp_path: Path) -> None:
    done = cli(stack, "export", "--project", PROJECT, RUN, "-o", str(tmp_path / "r1.csv"))
    assert done.returncode == 0, done.stderr
    assert "values of reading/r1 written" in done.stdout and "step" in done.stderr  # the progress bar
    expected = logged()
    with open(tmp_path / "r1.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(expected)
    for row in rows:
        x = limits.NONFINITE_STRINGS.get(row["value"]) or float(row["value"])
        assert bits(x) == bits(expected[(int(row["step"]), int(row["rank"]), row["key"])]), row
    done = cli(
        stack,
        "export",
        "--project",
        PROJECT,
        RUN,
        "--format",
        "jsonl",
        "--keys",
        "train/loss",
        "-o",
        str(tmp_path / "r1.jsonl"),
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "r1.jsonl").read_text().splitlines()]
    assert len(lines) == sum(1 for (_, _, k) in expected if k == "train/loss")
    assert all(set(line["metrics"]) == {"train/loss"} for line in lines)
    listed = cli(stack, "runs", "--project", PROJECT)
    assert listed.returncode == 0 and RUN in listed.stdout and "STATUS" in listed.stdout, listed
    missing = cli(stack, "export", "--project", PROJECT, "no-such-run")
    assert missing.returncode == 2 and "not found" in missing.stderr


@pytest.fixture
def second_stack(tmp_path: Path) -> Iterator[Any]:
    from infra.local import LocalStack

    other = LocalStack(port=0, data_dir=tmp_path / "second").start()
    try:
        yield other
    finally:
        other.stop()


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's data, without how this read was served: `resolution` says whether rollup blocks or raw
    events were read, which depends on whether each stack's rollup job has run yet, not on the run."""
    skip = ("version", "generated_at", "computed_at")
    same = {k: v for k, v in summary.items() if k not in skip}
    read_path = ("rollup_blocks_read", "events_read", "late_steps_read")
    same["resolution"] = {k: v for k, v in summary.get("resolution", {}).items() if k not in read_path}
    return same


def test_a_run_moves_to_another_stack_with_every_value_and_event_id(
    stack: Any, second_stack: Any, tmp_path: Path
) -> None:
    spool = tmp_path / "moved"
    done = cli(stack, "export", "--project", PROJECT, RUN, "--format", "spool", "-o", str(spool))
    assert done.returncode == 0, done.stderr
    env_other = {"INSTANTML_API_KEY": second_stack.token, "PATH": "/usr/bin:/bin"}
    sync = subprocess.run(
        [sys.executable, "-m", "instantml.cli", "sync", str(spool), "--api-url", second_stack.url, "--quiet"],
        env=env_other,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sync.returncode == 0, sync.stdout + sync.stderr
    here = im.Api(stack.url, stack.token).run(PROJECT, RUN)
    there = im.Api(second_stack.url, second_stack.token).run(PROJECT, RUN)
    assert [
        (r.step, r.rank, r.key, bits(r.value), r.weight, r.time, r.event_id) for r in there.rank_metrics()
    ] == [(r.step, r.rank, r.key, bits(r.value), r.weight, r.time, r.event_id) for r in here.rank_metrics()]
    assert [(r.step, r.key, bits(r.value)) for r in there.scalars()] == [
        (r.step, r.key, bits(r.value)) for r in here.scalars()
    ]
    assert there.config == here.config
    assert comparable(there.summary()) == comparable(here.summary())
    # The moved run's own events, replayed into the stack they came from, are all duplicates.
    again = tmp_path / "again"
    assert (
        cli(stack, "export", "--project", PROJECT, RUN, "--format", "spool", "-o", str(again)).returncode == 0
    )
    replay = cli(stack, "sync", str(again))
    assert replay.returncode == 0, replay.stderr
    assert "stored 0 " in replay.stderr or "stored 0" in replay.stdout + replay.stderr, (
        replay.stdout + replay.stderr
    )


def test_to_pandas_and_a_parquet_export_carry_the_same_values(stack: Any, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    values = im.Api(stack.url, stack.token).run(PROJECT, RUN).rank_metrics()
    frame = values.to_pandas()
    assert list(frame.columns) == ["step", "rank", "key", "value", "weight", "time", "event_id"]
    iterated = [(*row[:3], bits(row.value), bits(row.weight), bits(row.time), row.event_id) for row in values]
    framed = [
        (int(s), int(r), k, bits(v), bits(w), bits(t), i) for s, r, k, v, w, t, i in frame.itertuples(False)
    ]
    assert framed == iterated  # the same rows, in the same order
    expected = logged()
    assert len(frame) == len(expected)
    assert all(
        bits(v) == bits(expected[(s, r, k)])
        for s, r, k, v in zip(frame["step"], frame["rank"], frame["key"], frame["value"], strict=True)
    )
    done = cli(
        stack, "export", "--project", PROJECT, RUN, "--format", "parquet", "-o", str(tmp_path / "r1.parquet")
    )
    assert done.returncode == 0, done.stderr
    table = pq.read_table(tmp_path / "r1.parquet").to_pandas()

    def rows(df: Any) -> list[tuple[int, int, str, bytes]]:
        columns = (map(int, df["step"]), map(int, df["rank"]), df["key"], map(bits, df["value"]))
        return sorted(zip(*columns, strict=True))

    assert rows(table) == rows(frame)


def test_the_read_back_example_runs_against_the_stack(stack: Any, tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "read_back.py"
    done = subprocess.run(
        [sys.executable, str(example), "--project", PROJECT, RUN, "--key", "train/loss", "--rank", "5"],
        env={"INSTANTML_API_URL": stack.url, "INSTANTML_API_KEY": stack.token, "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"{PROJECT}/{RUN}: {sum(1 for k in logged() if k[2] == 'train/loss'):,} values of train/loss"
        in done.stdout
    )
    assert "rank 5 is outside its peers' 5-95% band at" in done.stdout
