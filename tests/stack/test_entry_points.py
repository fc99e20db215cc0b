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
    # Issue 24's terminal: links to each page, a JSON link a browser cannot follow given as the curl
    # command that works, the server's stop said with what keeps it serving, exact zeros for equal values.
    out = done.stdout
    for page in ("Runs page:", "Run page, clean run:", "Run page, faulty run:", "Both runs side by side:"):
        assert page in out, out
    curl = re.search(r'^Summary JSON: curl -H "Authorization: Bearer \$\(cat (\S+)\)" (\S+)$', out, re.M)
    assert curl and Path(curl[1]) == tmp_path / "token" and curl[2].endswith("/distributed"), out
    assert "stops its server now" in out and "`make serve`" in out
    grad = out.split("\noptimizer/grad_norm\n", 1)[1].split("\n\n", 1)[0]  # all-reduced: equal on every rank
    rows = [line.split() for line in grad.splitlines()[2:]]
    assert len(rows) == 5 and all(row[6] == "0" for row in rows), grad  # std: not 4.441e-16
    assert "(0 new, 0 already there)" not in done.stdout + done.stderr


def test_the_serving_demo_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """`make serve` stopped by SIGTERM (a process manager, `kill`): its stack's pools and queues are shut
    down, so Python's resource tracker has no leaked semaphore to warn of."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.demo",
            "--serve",
            "--port",
            "0",
            "--steps",
            "10",
            "--data-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # pytest's timeout bounds a demo that never serves
            if line.startswith("Serving until Ctrl-C"):
                break
        proc.terminate()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 1), err  # 1 would be a failed check, not the stop
    assert "leaked semaphore" not in err and "Traceback" not in err, err


def test_instantml_local_links_the_projects_its_data_dir_holds(tmp_path: Path) -> None:
    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(BIN / "instantml"), "local", "--port", "0", "--token", "t0k", "--data-dir", str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def until_ready(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        printed = ""
        for line in proc.stdout:
            printed += line
            if line.startswith("Ctrl-C"):
                return printed
        raise AssertionError(printed)

    proc = start()
    try:
        printed = until_ready(proc)
        assert "/v1/projects/PROJECT/view#token=t0k" in printed  # nothing stored yet: the placeholder
        url = re.search(r"http://127\.0\.0\.1:\d+", printed)
        assert url
        for project in ("vision", "nlp"):
            request = urllib.request.Request(
                url.group(0) + f"/v1/projects/{project}/runs/r/rank-metrics",
                data=json.dumps({"step": 0, "rank": 0, "world_size": 1, "metrics": {"a": 1.0}}).encode(),
                headers={
                    "Authorization": "Bearer t0k",
                    "Idempotency-Key": project,
                    "Content-Type": "application/json",
                },
                method="POST",
            )
            # 120 s: the first request waits for the ingest worker to import, 15 s on a loaded machine
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 201
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    proc = start()
    try:
        printed = until_ready(proc)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    assert "projects/PROJECT/view" not in printed, printed
    assert "Runs pages of the 2 project(s) stored here:" in printed
    assert re.search(
        r"^\s+nlp \(1 run\(s\)\): http://127\.0\.0\.1:\d+/v1/projects/nlp/view#token=t0k$", printed, re.M
    )
    assert re.search(
        r"^\s+vision \(1 run\(s\)\): http://127\.0\.0\.1:\d+/v1/projects/vision/view$", printed, re.M
    )


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
    # The stream names step 200: the steps up to 190 are rolled up, that is the 8 sample events at step
    # 100, as a level-1 block and the blocks of 10, 100, 1,000 and 10,000 steps above it.
    assert responses[4]["runs"] == [
        {"project": "distributed-job", "run_id": "r1", "blocks": 5, "events": 8, "through": 190, "left": 0}
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
