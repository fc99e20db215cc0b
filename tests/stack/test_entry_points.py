"""README's commands and the CLI, run as real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_the_demo_checks_its_own_summary(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "infra.demo", "--port", "0", "--steps", "40", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Check passed: last step coverage 8 of 8" in done.stdout
    assert re.search(r"^\s+39\s+8/8\s", done.stdout, re.M)  # the table's last row
    assert "/distributed/view#token=" in done.stdout


def test_invoke_runs_the_sample_events_through_the_template_functions() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.invoke",
            "IngestFunction",
            "events/post_rank_metrics.json",
            "IngestFunction",
            "events/post_rank_metrics_batch.json",
            "SummarizeFunction",
            "events/get_distributed.json",
            "SummarizeFunction",
            "events/get_distributed_view.json",
            "RollupFunction",
            "events/rollup_stream.json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    responses = json.loads("[" + re.sub(r"\}\n\{", "},{", done.stdout) + "]")
    assert [r["statusCode"] for r in responses[:4]] == [201, 200, 200, 200]
    assert json.loads(responses[2]["body"])["coverage"]["reported"] == [8]
    # The stream names a step in block 2: block 1 (the 8 sample events at step 100) is rolled up.
    assert responses[4]["runs"] == [
        {"project": "distributed-job", "run_id": "r1", "blocks": 1, "events": 8, "through": 1, "left": 0}
    ]


def test_instantml_local_serves_until_stopped(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            str(BIN / "instantml"),
            "local",
            "--port",
            "0",
            "--token",
            "local-test-token",
            "--data-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", first)
        assert url, first
        request = urllib.request.Request(
            url.group(0) + "/v1/projects/p/runs/r/rank-metrics",
            data=json.dumps({"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}}).encode(),
            headers={
                "Authorization": "Bearer local-test-token",
                "Idempotency-Key": "e1",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201
        printed = "".join(proc.stdout.readline() for _ in range(3))
        assert f"data: {tmp_path}" in printed and "INSTANTML_API_KEY=local-test-token" in printed
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM stops it cleanly
