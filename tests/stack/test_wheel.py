"""The package as users install it: a wheel built from the tracked files, installed in clean venvs.

Without the extra it is the client alone: no dependencies, nothing of the server imported, no top-level
module besides ``instantml``, and the server's commands say what they need. With ``[server]`` it runs
``instantml local`` with no checkout, from a directory holding a user's own ``shared`` and ``infra``
packages (which must neither break the server nor be shadowed), takes a two-rank job logged in spool
mode and synced with ``instantml sync``, and answers its summary; ``instantml tokens`` lists the stack's
token.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from instantml import routes

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / ".cache" / "uv" / "bin" / "uv"  # the Makefile's, when set up through it
SERVER_NAMES = ("shared", "functions", "infra")
PROJECT, RUN, RANKS, STEPS = "wheel", "wheel-job", 2, 20


def run(cmd: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)


def ok(cmd: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = run(cmd, **kwargs)
    assert done.returncode == 0, f"{cmd}: {done.stdout}\n{done.stderr}"
    return done


def tracked_copy(destination: Path) -> Path:
    """The project's tracked files, as an sdist would hold them (a build in the checkout leaves files)."""
    listed = run(["git", "-C", ROOT, "ls-files", "-z"])
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the wheel is built from the tracked files")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def new_venv(path: Path) -> Path:
    if UV.is_file():
        ok([UV, "venv", "--quiet", "--python", sys.executable, path])
    else:
        ok([sys.executable, "-m", "venv", path])
    return path / "bin" / "python"


#: The server's dependencies at the versions the project locks (the extra pins only the direct ones).
LOCKED = ROOT / "infra" / "lock" / "server.txt"


def install(python: Path, requirement: str) -> None:
    if UV.is_file():
        ok([UV, "pip", "install", "--quiet", "--python", python, "-c", LOCKED, requirement])
    else:
        ok([python, "-m", "pip", "install", "--quiet", "-c", LOCKED, requirement])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tracked_copy(tmp_path_factory.mktemp("source"))
    dist = tmp_path_factory.mktemp("dist")
    if UV.is_file():
        ok([UV, "build", "--quiet", "--wheel", "--out-dir", dist, source])
    else:
        ok([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, source])
    (built,) = dist.glob("instantml-*.whl")
    return built


def site_packages(python: Path) -> Path:
    return Path(
        ok([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )


# Imports the client's modules, then checks that no server module came with them or can be imported.
PROBE = """
import importlib.util, sys
import instantml, instantml.cli, instantml.run, instantml.commands.sync
names = set(sys.argv[1:])
loaded = [m for m in sys.modules if m.split(".")[0] in names or m.startswith("instantml._server")]
assert not loaded, loaded
assert all(importlib.util.find_spec(n) is None for n in names), "a server module is importable"
"""


def test_the_client_alone_imports_no_server_code_and_the_server_commands_say_what_they_need(
    wheel: Path, tmp_path: Path
) -> None:
    python = new_venv(tmp_path / "venv")
    install(python, str(wheel))
    bin_dir = python.parent
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()

    top_level = {p.name for p in site_packages(python).iterdir() if not p.name.startswith(("_", "."))}
    assert not top_level & set(SERVER_NAMES), top_level
    assert "instantml" in top_level
    ok([python, "-c", PROBE, *SERVER_NAMES], cwd=elsewhere)

    usage = ok([bin_dir / "instantml", "--help"], cwd=elsewhere).stdout
    assert all(command in usage for command in ("local", "tokens", "sync"))
    helped = ok([bin_dir / "instantml", "local", "--help"], cwd=elsewhere).stdout
    assert "pip install 'instantml[server]'" in helped and "Missing here" in helped
    for command in (["local", "--port", "0"], ["tokens", "--data-dir", "d", "list"]):
        refused = run([bin_dir / "instantml", *command], cwd=elsewhere)
        assert refused.returncode == 2, refused
        assert "pip install 'instantml[server]'" in refused.stderr and "numpy" in refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.fixture
def server_venv(wheel: Path, tmp_path: Path) -> Path:
    python = new_venv(tmp_path / "venv")
    install(python, f"instantml[server] @ {wheel.as_uri()}")
    return python


@pytest.fixture
def users_project(tmp_path: Path) -> Path:
    """A user's working directory with packages named like the server's, which break when imported."""
    project = tmp_path / "project"
    for name in SERVER_NAMES:
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name}')\n")
    return project


@pytest.fixture
def stack(server_venv: Path, users_project: Path, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    data_dir, errors = tmp_path / "data", (tmp_path / "stderr").open("w+")
    command = [server_venv.parent / "instantml", "local", "--port", "0", "--data-dir", data_dir]
    process = subprocess.Popen(
        [str(c) for c in command], cwd=users_project, stdout=subprocess.PIPE, stderr=errors, text=True
    )
    try:
        url = token = ""
        assert process.stdout is not None
        for line in process.stdout:  # until its links are printed (pytest's timeout bounds a silent stack)
            if line.startswith("InstantML local API on "):
                url = line.split(" on ", 1)[1].strip()
            if "INSTANTML_API_KEY=" in line:
                token = line.strip().split("=", 1)[1]
            if line.startswith("Ctrl-C"):
                break
        assert url and token, errors.seek(0) or errors.read()
        yield url, token, data_dir
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        errors.seek(0)
        assert "Traceback" not in errors.read()
        errors.close()


JOB = """
import sys, instantml as im
rank = int(sys.argv[1])
with im.init(project={project!r}, run_id={run!r}, upload_mode="offline", spool_dir=sys.argv[2]) as run:
    for step in range({steps}):
        run.log_rank_metrics({{"train/loss": rank + step / 100}}, step=step, rank=rank, world_size={ranks},
                             weight=1 + rank)
"""


def test_the_wheel_with_the_server_extra_runs_instantml_local_with_no_checkout(
    server_venv: Path, users_project: Path, stack: tuple[str, str, Path], tmp_path: Path
) -> None:
    url, token, data_dir = stack
    bin_dir = server_venv.parent
    env = {**os.environ, "INSTANTML_API_URL": url, "INSTANTML_API_KEY": token}
    env.pop("PYTHONPATH", None)
    spool = tmp_path / "spool"
    job = JOB.format(project=PROJECT, run=RUN, steps=STEPS, ranks=RANKS)
    for rank in range(RANKS):
        ok([server_venv, "-c", job, str(rank), spool], cwd=users_project, env=env)
    ok([bin_dir / "instantml", "sync", spool, "--quiet", "--timeout", "120"], cwd=users_project, env=env)

    request = urllib.request.Request(
        url + routes.DISTRIBUTED.format(project=PROJECT, run_id=RUN),
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        summary = json.loads(response.read())
    assert summary["ranks"] == list(range(RANKS)) and summary["steps"] == list(range(STEPS))
    assert summary["coverage"]["reported"] == [RANKS] * STEPS
    loss = summary["reducers"]["train/loss"]
    for step in range(STEPS):
        values = [rank + step / 100 for rank in range(RANKS)]
        weights = [1 + rank for rank in range(RANKS)]
        assert math.isclose(loss["mean"][step], sum(values) / RANKS, rel_tol=1e-12)
        expected = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
        assert math.isclose(loss["weighted_mean"][step], expected, rel_tol=1e-12)

    listed = ok([bin_dir / "instantml", "tokens", "--data-dir", data_dir, "list"], cwd=users_project, env=env)
    assert "instantml local" in listed.stdout
