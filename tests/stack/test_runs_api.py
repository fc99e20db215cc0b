"""Runs index, run.log scalars, config and run lifecycle over HTTP through the real local stack."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import pytest

from instantml import limits, routes
from tests.faults import call


def path(route: str, project: str, run_id: str | None = None) -> str:
    return route.format(project=project, run_id=run_id)


def rank_events(steps: range, ranks: range, world_size: int, prefix: str = "") -> dict[str, Any]:
    return {
        "events": [
            {
                "event_id": f"{prefix}{s}-{r}",
                "step": s,
                "rank": r,
                "world_size": world_size,
                "metrics": {"x": 1.0},
            }
            for s in steps
            for r in ranks
        ]
    }


def test_a_run_record_follows_its_events_config_and_end(local_stack: Any) -> None:
    project, run = "runs-life", "job-1"
    status, body = call(
        local_stack, "POST", path(routes.RANK_METRICS_BATCH, project, run), rank_events(range(5), range(4), 4)
    )
    assert status == 200 and body["stored"] == 20
    # The last step reached by 3 of 4 ranks so far; an older step afterwards changes nothing.
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, project, run),
        rank_events(range(5, 6), range(3), 4, "b"),
    )
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, project, run),
        rank_events(range(2, 3), range(4), 4, "c"),
    )
    status, record = call(local_stack, "GET", path(routes.RUN, project, run))
    assert status == 200
    assert (record["last_step"], record["world_size"], record["ranks_reporting"]) == (5, 4, 3)
    assert record["status"] == "live" and record["config"] is None and record["findings"] is None
    assert record["created"] <= record["last_event"] <= time.time()

    status, record = call(
        local_stack, "PATCH", path(routes.RUN, project, run), {"config": {"lr": 0.1, "model": {"layers": 12}}}
    )
    assert status == 200 and record["config"] == {"lr": 0.1, "model": {"layers": 12}}
    assert (
        call(local_stack, "GET", path(routes.RUN, project, run))[1]["hosts"] == {}
    )  # none has said its host
    for hosts in (
        {"0": "node-a", "1": "node-a"},
        {"2": "node-b"},
        {"1": "node-c"},
    ):  # one by one, as ranks do
        status, _ = call(local_stack, "PATCH", path(routes.RUN, project, run), {"hosts": hosts})
        assert status == 200
    status, record = call(local_stack, "GET", path(routes.RUN, project, run))
    assert record["hosts"] == {"0": "node-a", "1": "node-c", "2": "node-b"} and record["config"]["lr"] == 0.1
    status, record = call(local_stack, "PATCH", path(routes.RUN, project, run), {"status": "finished"})
    assert status == 200 and record["status"] == "finished" and record["config"]["lr"] == 0.1
    finished = record["finished"]
    # Late events of other ranks arrive after rank 0 finished: still finished, at the first time.
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, project, run),
        rank_events(range(5, 6), range(3, 4), 4, "d"),
    )
    status, record = call(local_stack, "PATCH", path(routes.RUN, project, run), {"status": "finished"})
    assert (
        record["status"] == "finished" and record["finished"] == finished and record["ranks_reporting"] == 4
    )

    # A full summary records its findings counts; a windowed one does not change them.
    status, _ = call(local_stack, "GET", path(routes.DISTRIBUTED, project, run))
    assert status == 200
    status, record = call(local_stack, "GET", path(routes.RUN, project, run))
    assert set(record["findings"]) == {"critical", "warning", "info"} and record["findings_at"] is not None


def test_runs_are_listed_newest_first_page_by_page_and_by_status(local_stack: Any) -> None:
    project = "runs-index"
    now = time.time()
    for i in range(12):
        body = {
            "events": [
                {
                    "event_id": "e",
                    "step": 0,
                    "rank": 0,
                    "world_size": 1,
                    "metrics": {"x": 1.0},
                    "time": now - 1000 + i,
                }
            ]
        }
        assert (
            call(local_stack, "POST", path(routes.RANK_METRICS_BATCH, project, f"run-{i:02d}"), body)[0]
            == 200
        )
    # run-11 is the newest activity; run-00 and run-01 have had none for over 5 minutes (idle) ...
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, project, "run-11"),
        rank_events(range(1, 2), range(1), 1),
    )
    call(local_stack, "PATCH", path(routes.RUN, project, "run-05"), {"status": "finished"})
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, "runs-other", "elsewhere"),
        rank_events(range(1), range(1), 1),
    )

    seen, cursor = [], None
    while True:
        query = "?limit=5" + (f"&cursor={quote(cursor)}" if cursor else "")
        status, page = call(local_stack, "GET", path(routes.RUNS, project) + query)
        assert status == 200 and len(page["runs"]) <= 5
        seen += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    # run-05 was finished just now (activity), run-11 logged just now: newest first.
    assert seen[:2] == ["run-05", "run-11"] or seen[:2] == ["run-11", "run-05"]
    assert sorted(seen) == [f"run-{i:02d}" for i in range(12)] and len(seen) == 12
    assert seen[2:] == [f"run-{i:02d}" for i in (10, 9, 8, 7, 6, 4, 3, 2, 1, 0)]

    by_status = {}
    for status_name in ("live", "idle", "finished"):
        status, page = call(local_stack, "GET", path(routes.RUNS, project) + f"?status={status_name}")
        assert status == 200
        by_status[status_name] = {r["run_id"] for r in page["runs"]}
        assert all(r["status"] == status_name for r in page["runs"])
    assert by_status["finished"] == {"run-05"}
    assert by_status["live"] == {"run-11"}
    assert len(by_status["idle"]) == 10
    status, page = call(local_stack, "GET", path(routes.RUNS, project) + "?status=live,finished")
    assert {r["run_id"] for r in page["runs"]} == {"run-05", "run-11"}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?status=running", "status"),
        ("?cursor=not-a-cursor", "cursor"),
        ("?limit=0", "limit"),
        ("?limit=x", "limit"),
        ("?limit=%C2%B2", "limit"),  # "²": a digit to str.isdigit, not to int()
        ("?limit=" + "9" * 5000, "limit"),  # past int()'s digit limit
        (
            "?cursor=WzEwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwLCJyIl0",
            "cursor",
        ),  # a float overflows
        ("?cursor=W05hTiwiciJd", "cursor"),
        ("?order=asc", "order"),
    ],
)
def test_a_bad_runs_query_is_a_400_naming_the_field(local_stack: Any, query: str, field: str) -> None:
    status, body = call(local_stack, "GET", path(routes.RUNS, "runs-bad") + query)
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert [d["field"] for d in body["error"]["details"]] == [field]


def test_a_token_of_another_project_cannot_list_its_runs(local_stack: Any) -> None:
    from shared.store import open_token_store

    token, _ = open_token_store(local_stack.store_url).create("runs-team-a", "runs test")
    call(
        local_stack,
        "POST",
        path(routes.RANK_METRICS_BATCH, "runs-team-b", "secret"),
        rank_events(range(1), range(1), 1),
    )
    status, body = call(local_stack, "GET", path(routes.RUNS, "runs-team-b"), token=token)
    assert status == 403 and "secret" not in json.dumps(body)
    status, body = call(local_stack, "GET", path(routes.RUNS, "runs-team-a"), token=token)
    assert status == 200 and body["runs"] == []
    status, body = call(local_stack, "GET", path(routes.RUNS, "runs-team-a"), token="wrong")
    assert status == 401


def test_scalars_are_stored_once_binned_and_late_steps_kept(local_stack: Any) -> None:
    project, run = "runs-scalars", "job"
    batch = {
        "events": [
            {"event_id": f"s{s}", "step": s, "metrics": {"train/loss": 10.0 - s / 10, "lr": 0.1}}
            for s in range(100, 0, -1)
        ]
    }
    status, body = call(local_stack, "POST", path(routes.SCALARS_BATCH, project, run), batch)
    assert status == 200 and body["stored"] == 100
    status, body = call(local_stack, "POST", path(routes.SCALARS_BATCH, project, run), batch)
    assert body["duplicate"] == 100 and body["stored"] == 0
    # A late step 0, a NaN, a second rank, and a re-logged step whose later time wins.
    one = path(routes.SCALARS, project, run)
    assert call(local_stack, "POST", one, {"step": 0, "metrics": {"train/loss": 10.0}})[0] == 201
    assert call(local_stack, "POST", one, {"step": 101, "metrics": {"train/loss": "NaN"}})[0] == 201
    assert call(local_stack, "POST", one, {"step": 5, "rank": 1, "metrics": {"train/loss": 3.0}})[0] == 201
    now = time.time()
    call(local_stack, "POST", one, {"step": 50, "metrics": {"lr": 0.5}, "time": now + 1})
    status, body = call(local_stack, "GET", path(routes.SCALARS, project, run) + "?max_steps=1000")
    assert status == 200 and body["keys"] == ["lr", "train/loss"]
    series = {(s["key"], s["rank"]): s for s in body["series"]}
    assert set(series) == {("lr", 0), ("train/loss", 0), ("train/loss", 1)}
    loss = series[("train/loss", 0)]
    assert loss["points"] == 102 and loss["steps"] == list(range(102)) and loss["bin"] == 1
    assert loss["last"][-1] == "NaN" and loss["mean"][-1] is None and loss["mean"][0] == 10.0
    assert series[("lr", 0)]["last"][49] == 0.5  # step 50 (lr starts at step 1)
    status, body = call(
        local_stack, "GET", path(routes.SCALARS, project, run) + "?keys=train/loss&max_steps=10"
    )
    binned = {(s["key"], s["rank"]): s for s in body["series"]}
    loss = binned[("train/loss", 0)]
    assert loss["bin"] == 11 and len(loss["steps"]) == 10 and loss["steps"][-1] == 101
    assert loss["min"][0] == pytest.approx(9.0) and loss["max"][0] == 10.0  # steps 0..10
    assert set(binned) == {("train/loss", 0), ("train/loss", 1)}
    # Scalars are not rank events: the run's Distributed summary has none of them.
    assert call(local_stack, "GET", path(routes.DISTRIBUTED, project, run))[0] == 404
    status, record = call(local_stack, "GET", path(routes.RUN, project, run))
    assert status == 200 and record["last_step"] is None and record["status"] == "live"


@pytest.mark.parametrize(
    ("method", "route", "body", "code", "field"),
    [
        ("PATCH", routes.RUN, {"config": [1, 2]}, 400, "config"),
        ("PATCH", routes.RUN, {"config": {"x": "a" * limits.MAX_CONFIG_BYTES}}, 413, "config"),
        ("PATCH", routes.RUN, {"status": "done"}, 400, "status"),
        ("PATCH", routes.RUN, {}, 400, "body"),
        ("PATCH", routes.RUN, {"config": {}, "colour": 1}, 400, "colour"),
        ("PATCH", routes.RUN, {"hosts": {}}, 400, "hosts"),
        ("PATCH", routes.RUN, {"hosts": {"512": "node-a"}}, 400, "hosts"),
        ("PATCH", routes.RUN, {"hosts": {"03": "node-a"}}, 400, "hosts"),
        ("PATCH", routes.RUN, {"hosts": {"3": "node a"}}, 400, "hosts"),
        ("PATCH", routes.RUN, {"hosts": {"3": 7}}, 400, "hosts"),
        ("POST", routes.SCALARS, {"step": 1, "metrics": {"loss": "high"}}, 400, "metrics.loss"),
        ("POST", routes.SCALARS, {"step": 1, "metrics": {"loss": True}}, 400, "metrics.loss"),
        ("POST", routes.SCALARS, {"step": -1, "metrics": {"loss": 1.0}}, 400, "step"),
        ("POST", routes.SCALARS, {"step": 1, "world_size": 8, "metrics": {"loss": 1.0}}, 400, "world_size"),
    ],
)
def test_bad_updates_and_scalars_are_refused_naming_the_field_and_store_nothing(
    local_stack: Any, method: str, route: str, body: Any, code: int, field: str
) -> None:
    project, run = "runs-refused", f"r{abs(hash((method, json.dumps(body)[:100]))) % 10**8}"
    status, answer = call(local_stack, method, path(route, project, run), body)
    assert status == code, answer
    fields = [
        d["field"].split(".")[0] if field != "metrics.loss" else d["field"]
        for d in answer["error"].get("details", [])
    ]
    assert field in fields or any(f.startswith(field) for f in fields), answer
    assert call(local_stack, "GET", path(routes.RUN, project, run))[0] == 404


def test_an_unknown_run_is_a_404_for_its_record_and_scalars(local_stack: Any) -> None:
    for route in (routes.RUN, routes.SCALARS):
        status, body = call(local_stack, "GET", path(route, "runs-none", "nothing"))
        assert status == 404 and body["error"]["code"] == "not_found"


def _config_just_under_the_limit() -> dict[str, int]:
    """A config of compact size just under 64 KiB whose JSON with the default separators (", ", ": ") is
    past what the server takes for a run update."""
    config = {f"k{i:05d}": 1 for i in range(limits.MAX_CONFIG_BYTES // 11)}
    assert len(json.dumps(config, separators=(",", ":"))) <= limits.MAX_CONFIG_BYTES
    assert len(json.dumps(config)) > limits.MAX_CONFIG_BYTES + 1024
    return config


@pytest.mark.parametrize("mode", ["thread", "offline"])
def test_a_config_just_under_the_limit_is_stored_from_every_sink(
    local_stack: Any, tmp_path: Any, mode: str
) -> None:
    import instantml as im
    from instantml.commands import sync

    project, run_id, config = "runs-config", f"big-{mode}", _config_just_under_the_limit()
    run = im.init(
        project=project,
        run_id=run_id,
        upload_mode=mode,
        spool_dir=tmp_path,
        api_url=local_stack.url,
        api_key=local_stack.token,
        config=config,
    )
    run.log_rank_metrics({"train/loss": 1.0}, step=0, rank=0, world_size=1)
    run.finish(timeout=60)
    if mode == "offline":
        assert sync.command(str(tmp_path), local_stack.url, local_stack.token, 60.0, True) == 0
    status, record = call(local_stack, "GET", path(routes.RUN, project, run_id))
    assert status == 200 and record["status"] == "finished"
    assert record["config"] == config
