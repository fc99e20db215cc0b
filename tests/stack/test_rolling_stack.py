"""Rollups on the local stack: events posted over HTTP reach the database's change feed, the rollup
worker rolls the blocks up in the background, and the summary reads them, late events included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from instantml import routes
from shared.summary.rolling import SETTLE_STEPS
from tests.faults import api, wait_for

PROJECT = "rolling"


def post_steps(stack: Any, run_id: str, ranks: list[int], steps: range, world: int = 4) -> None:
    path = routes.RANK_METRICS_BATCH.format(project=PROJECT, run_id=run_id)
    events = [
        {
            "event_id": f"{rank}-{step}",
            "step": step,
            "rank": rank,
            "world_size": world,
            "metrics": {"train/loss": 1.0 + rank + step / 1000},
        }
        for step in steps
        for rank in ranks
    ]
    for i in range(0, len(events), 500):
        result = api(stack, path, {"events": events[i : i + 500]})
        assert all(r["status"] == "stored" for r in result["results"]), result


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from infra.local import LocalStack

    with LocalStack(port=0, data_dir=tmp_path_factory.mktemp("rolling")) as stack:
        yield stack


def test_steps_are_rolled_up_in_the_background_and_late_events_are_counted(local_stack: Any) -> None:
    distributed = routes.DISTRIBUTED.format(project=PROJECT, run_id="bg") + "?max_steps=25"
    post_steps(local_stack, "bg", [0, 1, 2], range(250))  # rank 3 never reports

    def rolled() -> Any:
        document = api(local_stack, distributed)
        return document if document["resolution"]["events_read"] == 3 * SETTLE_STEPS else None

    # Steps 0-239 are rolled up; the newest 10 wait for their ranks and are read event by event.
    document = wait_for(rolled, what="the steps up to 239 rolled up")
    assert (document["resolution"]["unit"], document["resolution"]["level_steps"]) == ("level", 10)
    assert len(document["steps"]) == 25 and document["resolution"]["rollup_blocks_read"] >= 24
    assert document["reducers"]["train/loss"]["count"] == [3] * 25
    assert document["coverage"]["missing"] == [[3]] * 25
    stopped = [f for f in document["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["severity"]) for f in stopped] == [(3, "critical")]
    assert "at 250 steps" in stopped[0]["message"]

    # Rank 3's spool is replayed late, behind the mark: its steps and the blocks above are rolled again.
    post_steps(local_stack, "bg", [3], range(200))
    document = wait_for(
        lambda: (d := api(local_stack, distributed))["coverage"]["missing"] == [[]] * 20 + [[3]] * 5 and d,
        what="steps 0-199 rolled up again with all of rank 3's",
    )
    assert document["reducers"]["train/loss"]["count"] == [4] * 20 + [3] * 5
    assert [r["last_step"] for r in document["rank_stats"]] == [249, 249, 249, 199]


def test_a_live_refresh_over_http_moves_the_new_columns_and_applies_to_the_whole_document(
    local_stack: Any,
) -> None:
    from tests.unit.test_wire import _apply, _same

    distributed = routes.DISTRIBUTED.format(project=PROJECT, run_id="live") + "?max_steps=50"
    post_steps(local_stack, "live", [0, 1, 2, 3], range(120))
    first = api(local_stack, distributed)
    post_steps(local_stack, "live", [0, 1, 2, 3], range(120, 121))
    # How a document was read (its resolution: blocks and events) is part of it, and the rollup worker
    # rolls up to SETTLE_STEPS behind the newest step: once it has, the two reads below are read alike.
    wait_for(
        lambda: api(local_stack, distributed)["resolution"]["events_read"] <= 4 * SETTLE_STEPS,
        what="the rollups up to step 110",
    )
    refresh = api(local_stack, distributed + "&since=" + first["version"])
    whole = api(local_stack, distributed)
    # Single steps (121 steps, 50 columns at most): the same numbers whether a step is rolled up yet.
    assert refresh["since"] == first["version"] and refresh["from_column"] == 40 == len(first["steps"])
    assert len(json.dumps(refresh)) < len(json.dumps(whole)) / 2
    _same(_apply(first, refresh), whole)
