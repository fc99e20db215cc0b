"""A real distributed client: ``torchrun --nproc-per-node 4`` runs examples/torchrun_ddp.py (DDP on the
CPU, gloo) in spool mode against the local stack; the run id, ranks and world size come from torchrun
alone.

It drives ``.cache/venv-torch``'s ``torchrun`` (``tests.torchrun_jobs``).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from instantml import routes
from tests.faults import call, wait_for
from tests.torchrun_jobs import ROOT, TORCHRUN, run_example

pytestmark = pytest.mark.torch

STEPS = 30


@pytest.mark.skipif(not TORCHRUN.exists(), reason="no .cache/venv-torch: `make test` builds it")
def test_torchrun_ddp_on_four_ranks_reaches_the_summary(local_stack: Any, tmp_path: Path) -> None:
    example = (ROOT / "examples" / "torchrun_ddp.py").read_text()
    assert "run_id" not in example and "TORCHELASTIC" not in example.split('"""')[2]
    assert "rank=" not in example and "world_size=" not in example  # the launcher's RANK, WORLD_SIZE
    run_example(local_stack, "torchrun_ddp.py", 4, "ddp-job-7", tmp_path, {"STEPS": str(STEPS)})
    path = routes.DISTRIBUTED.format(project="torchrun-ddp", run_id="ddp-job-7")
    request = urllib.request.Request(
        local_stack.url + path, headers={"Authorization": f"Bearer {local_stack.token}"}
    )

    def counted() -> Any:  # a rank's late batch is counted by the rollup worker within seconds
        with urllib.request.urlopen(request, timeout=60) as response:
            summary = json.load(response)
        return summary if summary["coverage"]["reported"] == [4] * STEPS else None

    summary = wait_for(counted, 60, "every rank counted")
    assert summary["world_size"] == 4 and summary["ranks"] == [0, 1, 2, 3]
    assert summary["steps"] == list(range(STEPS))
    assert summary["coverage"]["reported"] == [4] * STEPS
    assert set(summary["keys"]) == {"train/loss", "optimizer/grad_norm", "system/step_time_ms"}
    # Each rank reads its own shard, so losses differ; DDP all-reduces gradients, so grad norms agree.
    loss, grad = summary["reducers"]["train/loss"], summary["reducers"]["optimizer/grad_norm"]
    assert all(r > 0 for r in loss["range"])
    assert all(r <= 1e-4 * m for r, m in zip(grad["range"], grad["max"], strict=True))
    assert not [f for f in summary["findings"] if f["kind"] == "rank_disagreement"]

    # Rank 0's run.log: the all-reduced loss is the mean of the ranks' own losses at every step.
    status, scalars = call(
        local_stack, "GET", routes.SCALARS.format(project="torchrun-ddp", run_id="ddp-job-7")
    )
    assert status == 200 and scalars["keys"] == ["lr", "train/loss"]
    series = {(s["key"], s["rank"]): s for s in scalars["series"]}
    assert set(series) == {("lr", 0), ("train/loss", 0)}
    logged = series[("train/loss", 0)]
    assert logged["steps"] == list(range(STEPS)) and series[("lr", 0)]["last"] == [0.01] * STEPS
    assert logged["last"] == pytest.approx(loss["mean"], rel=1e-5)
    # The run's record: config from im.init, finished by rank 0, every rank at the last step.
    status, record = call(local_stack, "GET", routes.RUN.format(project="torchrun-ddp", run_id="ddp-job-7"))
    assert status == 200 and record["status"] == "finished"
    assert (record["world_size"], record["last_step"], record["ranks_reporting"]) == (4, STEPS - 1, 4)
    assert record["config"]["optimizer"] == "SGD" and record["config"]["steps"] == STEPS
