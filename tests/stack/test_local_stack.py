"""The local stack over real HTTP on loopback, driven by the real client from real processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from typing import Any

import pytest

from instantml import routes
from tests.faults import wait_for

PROJECT = "stack-test"


def get(stack: Any, path: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token or stack.token}"}
    request = urllib.request.Request(stack.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, instantml as im
    url, token, run_id = sys.argv[1:4]
    rank, world = int(sys.argv[4]), int(sys.argv[5])
    with im.init(project="stack-test", run_id=run_id, api_url=url, api_key=token, batch_size=7) as run:
        for step in range(20):
            run.log_rank_metrics({"train/loss": rank + step / 100, "system/step_time": 0.5},
                                 step=step, rank=rank, world_size=world, weight=rank + 1)
    """
)


def test_ranks_in_separate_processes_reach_the_summary(local_stack: Any) -> None:
    world = 4
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                local_stack.url,
                local_stack.token,
                "procs",
                str(r),
                str(world),
            ]
        )
        for r in range(world)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * world

    path = routes.DISTRIBUTED.format(project=PROJECT, run_id="procs")
    # A rank's late batch lands behind the rollups' mark and is counted by the rollup worker within seconds.
    status, summary = wait_for(
        lambda: (
            (got := get(local_stack, path))[1].get("coverage", {}).get("reported") == [world] * 20 and got
        ),
        60,
        "every rank counted",
    )
    assert status == 200
    assert summary["steps"] == list(range(20))
    assert summary["coverage"]["reported"] == [world] * 20
    loss = summary["reducers"]["train/loss"]
    values = [r + 19 / 100 for r in range(world)]
    assert math.isclose(loss["mean"][-1], sum(values) / world, rel_tol=1e-12)
    weights = [r + 1 for r in range(world)]
    want = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    assert math.isclose(loss["weighted_mean"][-1], want, rel_tol=1e-12)
    # Weights grow with the rank and so do the values: the weighted mean differs (info), nothing else.
    assert [(f["kind"], f["severity"]) for f in summary["findings"]] == [("weighted_differs", "info")]


def test_a_stopped_rank_is_found_and_binning_keeps_the_columns_bounded(local_stack: Any) -> None:
    import instantml as im

    with im.init(
        project=PROJECT, run_id="stopped", api_url=local_stack.url, api_key=local_stack.token
    ) as run:
        for step in range(50):
            for rank in range(3):
                if rank == 2 and step > 30:
                    continue
                run.log_rank_metrics({"train/loss": 1.0 + rank}, step=step, rank=rank, world_size=3)
    status, summary = get(
        local_stack, routes.DISTRIBUTED.format(project=PROJECT, run_id="stopped") + "?max_steps=10"
    )
    assert status == 200
    assert (summary["bin_size"], len(summary["steps"])) == (5, 10)
    assert summary["coverage"]["missing"][-1] == [2]
    stopped = [f for f in summary["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["step"], f["severity"]) for f in stopped] == [(2, 30, "critical")]


def test_wrong_token_unknown_run_and_page_shell(local_stack: Any) -> None:
    path = routes.DISTRIBUTED.format(project=PROJECT, run_id="nothing-here")
    assert get(local_stack, path)[0] == 404
    status, body = get(local_stack, path, token="not-the-token")
    assert (status, body["error"]["code"]) == (401, "unauthorized")
    with urllib.request.urlopen(
        local_stack.url + routes.DISTRIBUTED_VIEW.format(project=PROJECT, run_id="x")
    ) as page:
        assert page.status == 200 and page.headers["content-type"].startswith("text/html")


def test_client_survives_a_rejecting_server(local_stack: Any, caplog: pytest.LogCaptureFixture) -> None:
    import instantml as im

    run = im.init(project=PROJECT, run_id="rejected", api_url=local_stack.url, api_key="wrong-token")
    run.log_rank_metrics({"train/loss": 1.0}, step=0, rank=0, world_size=1)
    run.finish(timeout=30)  # never raises because of the server
    # the event; the process's start and end records and the finished mark of finish(), apart
    assert "HTTP 401" in caplog.text and "1 event(s) and 3 run update(s) were not uploaded" in caplog.text


def test_concurrent_requests_each_get_their_own_answer(local_stack: Any) -> None:
    """The local stack serves requests in threads; each answer must belong to its own request."""
    from concurrent.futures import ThreadPoolExecutor

    path = routes.RANK_METRICS.format(project=PROJECT, run_id="concurrent")

    def post(i: int) -> str:
        body = {"step": i, "rank": 0, "world_size": 1, "metrics": {"train/loss": float(i)}}
        request = urllib.request.Request(
            local_stack.url + path,
            data=json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {local_stack.token}",
                "Content-Type": "application/json",
                "Idempotency-Key": f"c-{i}",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return str(json.load(response)["event_id"])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(120)))
    assert answers == [f"c-{i}" for i in range(120)]
    status, summary = get(local_stack, routes.DISTRIBUTED.format(project=PROJECT, run_id="concurrent"))
    assert (
        status == 200
        and summary["steps"] == list(range(120))
        and summary["heatmap"]["train/loss"]["values"][0] == [float(i) for i in range(120)]
    )
