"""`instantml local --dynamodb-endpoint URL`: the same stack on a DynamoDB endpoint (moto's server here,
as DynamoDB Local would be): tables made from the template when missing, events stored once, the
summary read back, and blocks rolled up from the table's stream by the template's rollup function."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from instantml import routes
from shared.summary.rolling import SETTLE_STEPS
from tests.faults import api, call, wait_for

PROJECT = "dynamo-local"


@pytest.fixture(scope="module")
def dynamo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import os

    from moto.server import ThreadedMotoServer

    from infra.local import LocalStack

    saved = dict(os.environ)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="local", AWS_SECRET_ACCESS_KEY="local", AWS_DEFAULT_REGION="us-east-1"
    )
    stack = LocalStack(
        port=0,
        data_dir=tmp_path_factory.mktemp("unused"),
        dynamodb_endpoint=f"http://{host}:{port}",
    )
    try:
        yield stack.start()
    finally:
        stack.stop()
        moto.stop()
        os.environ.clear()
        os.environ.update(saved)


def test_events_are_stored_once_summarized_and_rolled_up_on_a_dynamodb_endpoint(dynamo_stack: Any) -> None:
    path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id="r")
    events = [
        {"event_id": f"{r}-{s}", "step": s, "rank": r, "world_size": 2, "metrics": {"loss": r + s / 1000}}
        for s in range(150)
        for r in range(2)
    ]
    assert api(dynamo_stack, path, {"events": events})["stored"] == 300
    assert api(dynamo_stack, path, {"events": events[:10]})["duplicate"] == 10
    distributed = routes.DISTRIBUTED.format(project=PROJECT, run_id="r") + "?max_steps=15"
    document = wait_for(
        lambda: (d := api(dynamo_stack, distributed))["resolution"]["events_read"] == 2 * SETTLE_STEPS and d,
        what="steps 0-139 rolled up from the table's stream",
    )
    assert document["reducers"]["loss"]["count"] == [2] * 15  # 14 blocks of 10 rolled up, then steps read
    assert (document["resolution"]["unit"], document["resolution"]["rollup_blocks_read"]) == ("level", 14)
    assert sum(p.batches for p in dynamo_stack.pollers) >= 1


def test_run_records_scalars_and_the_runs_index_on_a_dynamodb_endpoint(dynamo_stack: Any) -> None:
    run = "listed"
    events = [
        {"event_id": f"{s}-{r}", "step": s, "rank": r, "world_size": 2, "metrics": {"x": 1.0}}
        for s in range(3)
        for r in range(2)
    ]
    assert (
        call(
            dynamo_stack,
            "POST",
            routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run),
            {"events": events},
        )[0]
        == 200
    )
    scalars = [{"event_id": f"s{s}", "step": s, "metrics": {"train/loss": 1.0 / (s + 1)}} for s in range(20)]
    path = routes.SCALARS_BATCH.format(project=PROJECT, run_id=run)
    assert call(dynamo_stack, "POST", path, {"events": scalars})[1]["stored"] == 20
    status, record = call(
        dynamo_stack,
        "PATCH",
        routes.RUN.format(project=PROJECT, run_id=run),
        {"config": {"lr": 3e-4}, "status": "finished"},
    )
    assert status == 200 and record["status"] == "finished" and record["config"] == {"lr": 3e-4}
    status, page = call(dynamo_stack, "GET", routes.RUNS.format(project=PROJECT) + "?status=finished")
    assert status == 200
    (listed,) = [r for r in page["runs"] if r["run_id"] == run]
    assert (listed["last_step"], listed["world_size"], listed["ranks_reporting"]) == (2, 2, 2)
    assert listed["config"] == {"lr": 3e-4}
    status, body = call(
        dynamo_stack, "GET", routes.SCALARS.format(project=PROJECT, run_id=run) + "?max_steps=5"
    )
    assert status == 200 and body["series"][0]["points"] == 20 and len(body["series"][0]["steps"]) == 5
