"""Run an example of examples/ under torchrun against a local stack, as a user would: spool mode, the
run id and ranks from torchrun alone, then wait until the spool has drained.

torch 2.13.0 installs for Python 3.11 only here: ``make test`` builds ``.cache/venv-torch`` with it and
the client installed; the tests that use this skip without it (``TORCHRUN.exists()``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from instantml.upload import spool
from instantml.upload.background import uploader_running
from tests.faults import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = ROOT / ".cache" / "venv-torch" / "bin" / "torchrun"


def torchrun_command(ranks: int, run_id: str, script: Path, *options: str) -> list[str]:
    """torchrun of ``script`` on this machine: one node, ``ranks`` processes, a free port."""
    return [
        str(TORCHRUN),
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--rdzv-id={run_id}",
        *options,
        str(script),
    ]


def run_example(
    stack: Any, example: str, ranks: int, run_id: str, workdir: Path, env: dict[str, str] | None = None
) -> None:
    """``torchrun --nproc-per-node RANKS examples/EXAMPLE`` with torchrun's ``--rdzv-id`` as the run id;
    ``env`` adds to (or, with ``""``, takes away from) the environment."""
    spool_dir = workdir / "spool"
    environ = dict(
        os.environ,
        INSTANTML_API_URL=stack.url,
        INSTANTML_API_KEY=stack.token,
        INSTANTML_SPOOL_DIR=str(spool_dir),
        OMP_NUM_THREADS="1",
    )
    environ.pop("INSTANTML_RUN_ID", None)  # the run id must come from torchrun
    for name, value in (env or {}).items():
        if value:
            environ[name] = value
        else:
            environ.pop(name, None)
    cmd = torchrun_command(ranks, run_id, ROOT / "examples" / example)
    result = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=240, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    wait_for(
        lambda: not uploader_running(spool_dir) and not spool.spool_files(spool_dir),
        120,
        "the spool to drain",
    )
