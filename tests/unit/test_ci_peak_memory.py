"""``.ci/peak_memory.py``: CI's whole-run peak memory, summed over every process of the run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "peak_memory.py"
MIB = 2**20

# Holds `size` MiB, says so on stdout, and keeps it until its stdin closes; with "spawn", first starts
# a child of its own that does the same (a grandchild of the caller).
HOLDER = textwrap.dedent(
    """
    import subprocess, sys
    size, spawn = int(sys.argv[1]), sys.argv[2:] == ["spawn"]
    child = None
    if spawn:
        child = subprocess.Popen([sys.executable, __file__, str(size)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
        child.stdout.readline()
    held = bytearray(size << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1  # touch every page: resident, not only reserved
    print("ready", flush=True)
    sys.stdin.read()
    if child is not None:
        child.stdin.close()
        child.wait()
    """
)


@pytest.fixture(scope="module")
def peak_memory() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peak_memory", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_is_the_command_and_every_descendant_and_their_rss_adds_up(
    peak_memory: ModuleType, tmp_path: Path
) -> None:
    holder = tmp_path / "holder.py"
    holder.write_text(HOLDER)
    process = subprocess.Popen(
        [sys.executable, str(holder), "64", "spawn"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"ready\n"
        members = peak_memory.tree(process.pid)
        assert process.pid in members, members
        assert len(members) == 2, members
        total = sum(peak_memory._rss(pid) for pid in members)
        assert total >= 2 * 64 * MIB  # both processes' buffers, not only the largest one's
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=60)


@pytest.mark.parametrize("code", [0, 3])
def test_it_prints_the_peak_and_keeps_the_exit_code(code: int) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--", sys.executable, "-c", f"raise SystemExit({code})"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == code, run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("peak memory of the whole run: ")


def test_a_signal_that_ends_the_command_is_128_plus_its_number() -> None:
    command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    run = subprocess.run([sys.executable, str(SCRIPT), "--", *command], capture_output=True, timeout=60)
    assert run.returncode == 128 + 15
