"""Rollups on the local stack: events posted over HTTP reach the database's change feed, the rollup
worker rolls the blocks up in the background, and the summary reads them, late events included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from instantml import routes
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
    """A stack whose summaries use rollups as soon as there are some."""
    from functions.summarize.app import RAW_EVENT_BUDGET_ENV
    from infra.local import LocalStack

    data_dir = tmp_path_factory.mktemp("rolling")
    with LocalStack(port=0, data_dir=data_dir, environment={RAW_EVENT_BUDGET_ENV: "100"}) as stack:
        yield stack


def test_blocks_are_rolled_up_in_the_background_and_late_events_are_counted(local_stack: Any) -> None:
    distributed = routes.DISTRIBUTED.format(project=PROJECT, run_id="bg") + "?max_steps=10"
    post_steps(local_stack, "bg", [0, 1, 2], range(250))  # rank 3 never reports before step 250

    def rolled(blocks: int) -> Any:
        document = api(local_stack, distributed)
        return document if document["resolution"]["rollup_blocks_read"] == blocks else None

    # Steps 0-249: blocks 0 and 1 are behind the run, block 2 is being written.
    document = wait_for(lambda: rolled(2), what="blocks 0 and 1 rolled up")
    assert document["resolution"]["unit"] == "block"
    assert document["resolution"]["events_read"] == 3 * 50
    assert document["reducers"]["train/loss"]["count"] == [3, 3, 3]
    assert document["coverage"]["missing"] == [[3], [3], [3]]
    stopped = [f for f in document["findings"] if f["kind"] == "stopped_reporting"]
    assert [(f["rank"], f["severity"]) for f in stopped] == [(3, "critical")]
    assert "at 250 steps" in stopped[0]["message"]

    # Rank 3's spool is replayed late, into the rolled-up blocks: they are rolled up again.
    post_steps(local_stack, "bg", [3], range(200))
    document = wait_for(
        lambda: (d := api(local_stack, distributed))["coverage"]["missing"] == [[], [], [3]] and d,
        what="blocks 0 and 1 rolled up again with all of rank 3's steps",
    )
    assert document["resolution"]["rollup_blocks_read"] == 2
    assert document["reducers"]["train/loss"]["count"] == [4, 4, 3]
    assert [r["last_step"] for r in document["rank_stats"]] == [249, 249, 249, 199]
