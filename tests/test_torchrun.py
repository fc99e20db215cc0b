"""A real distributed client: ``torchrun --nproc-per-node 4`` runs examples/torchrun_ddp.py (DDP on the
CPU, gloo) in spool mode against the local stack; the run id, ranks and world size come from torchrun
alone.

torch 2.13.0 installs for Python 3.11 only here: ``make test`` builds ``.cache/venv-torch`` with it and
the client installed, and this test drives that venv's ``torchrun``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from instantml import routes, spool
from instantml.replay import uploader_running
from tests.faults import wait_for

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = ROOT / ".cache" / "venv-torch" / "bin" / "torchrun"
STEPS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="no .cache/venv-torch: `make test` builds it")
def test_torchrun_ddp_on_four_ranks_reaches_the_summary(local_stack: Any, tmp_path: Path) -> None:
    example = (ROOT / "examples" / "torchrun_ddp.py").read_text()
    assert "run_id" not in example and "TORCHELASTIC" not in example.split('"""')[2]
    assert "rank=" not in example and "world_size=" not in example  # the launcher's RANK, WORLD_SIZE
    spool_dir = tmp_path / "spool"
    env = dict(
        os.environ,
        INSTANTML_API_URL=local_stack.url,
        INSTANTML_API_KEY=local_stack.token,
        INSTANTML_SPOOL_DIR=str(spool_dir),
        STEPS=str(STEPS),
        OMP_NUM_THREADS="1",
    )
    env.pop("INSTANTML_RUN_ID", None)
    cmd = [
        str(TORCHRUN),
        "--nnodes=1",
        "--nproc-per-node=4",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--rdzv-id=ddp-job-7",
        str(ROOT / "examples" / "torchrun_ddp.py"),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    wait_for(
        lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir),
        120,
        "the spool to drain",
    )
    path = routes.DISTRIBUTED.format(project="torchrun-ddp", run_id="ddp-job-7")
    request = urllib.request.Request(
        local_stack.url + path, headers={"Authorization": f"Bearer {local_stack.token}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        summary = json.load(response)
    assert summary["world_size"] == 4 and summary["ranks"] == [0, 1, 2, 3]
    assert summary["steps"] == list(range(STEPS))
    assert summary["coverage"]["reported"] == [4] * STEPS
    assert set(summary["keys"]) == {"train/loss", "optimizer/grad_norm", "system/step_time_ms"}
    # Each rank reads its own shard, so losses differ; DDP all-reduces gradients, so grad norms agree.
    loss, grad = summary["reducers"]["train/loss"], summary["reducers"]["optimizer/grad_norm"]
    assert all(r > 0 for r in loss["range"])
    assert all(r <= 1e-4 * m for r, m in zip(grad["range"], grad["max"], strict=True))
    assert not [f for f in summary["findings"] if f["kind"] == "rank_disagreement"]
