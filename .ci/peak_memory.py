#!/usr/bin/env python3
"""Run a command and print the peak memory of everything it started, all processes together.

    python3 .ci/peak_memory.py [--interval S] [--kill-above MIB] -- COMMAND [ARG...]

The command runs in a session of its own. Every ``--interval`` seconds the resident set sizes (RSS)
of all processes in that session, and of any descendant that left it, are summed; the largest sum is
the peak printed at the end, with the largest single process (the figure ``/usr/bin/time -v`` gives).
Summed RSS counts pages shared between processes once per process: an upper bound of the footprint.

The exit code is the command's (128 + N when a signal N ended it), whatever the memory. With
``--kill-above``, the whole session is killed as soon as the sum goes over that many MiB (a guard for
measuring a run that may exhaust the machine), and the exit code is 137.

Standard library and /proc only: it works on a fresh Linux machine with nothing installed. Elsewhere
it runs the command and says it could not measure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a process, None when it is gone or unreadable."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3])


def _rss(pid: int) -> int:
    try:
        return int((PROC / str(pid) / "statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree(root: int) -> list[int]:
    """The processes of ``root``'s session and every descendant of ``root``, wherever it went."""
    parents: dict[int, int] = {}
    members = {root}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None:
            continue
        parents[int(entry.name)] = stat[0]
        if stat[1] == root:  # the command leads its own session: session id == its pid
            members.add(int(entry.name))
    for pid in parents:
        chain, seen = pid, set()
        while chain > 1 and chain not in members and chain not in seen:
            seen.add(chain)
            chain = parents.get(chain, 0)
        if chain in members:
            members.add(pid)
    return sorted(members)


class Sampler(threading.Thread):
    def __init__(self, root: int, interval: float, kill_above: int | None) -> None:
        super().__init__(daemon=True, name="peak-memory")
        self.root, self.interval, self.kill_above = root, interval, kill_above
        self.peak = self.peak_processes = self.largest = self.samples = 0
        self.killed = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sizes = [_rss(pid) for pid in tree(self.root)]
            total = sum(sizes)
            self.samples += 1
            if total > self.peak:
                self.peak, self.peak_processes = total, len(sizes)
            self.largest = max(self.largest, *sizes, 0)
            if self.kill_above is not None and total > self.kill_above and not self.killed:
                self.killed = True
                print(f"peak_memory: {total >> 20} MiB, over --kill-above: killing the run", file=sys.stderr)
                _signal_session(self.root, signal.SIGKILL)
            self.done.wait(self.interval)


def _signal_session(root: int, signum: int) -> None:
    for pid in tree(root):
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signum)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples (0.2)")
    parser.add_argument("--kill-above", type=int, metavar="MIB", help="kill the run over this many MiB")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    process = subprocess.Popen(command, start_new_session=True)
    # Ctrl-C or a CI timeout stops the whole run, not only the sampler.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: _signal_session(process.pid, s))
    measuring = PROC.joinpath(str(process.pid), "statm").exists()
    sampler = Sampler(process.pid, args.interval, None if args.kill_above is None else args.kill_above << 20)
    started = time.monotonic()
    if measuring:
        sampler.start()
    code = process.wait()
    sampler.done.set()
    if measuring:
        sampler.join()
    elapsed = time.monotonic() - started

    if measuring:
        # ru_maxrss of the waited-for descendants: the largest single process, sampled by the kernel.
        largest = max(sampler.largest, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
        print(
            f"\npeak memory of the whole run: {sampler.peak / 2**20:,.0f} MiB "
            f"({sampler.peak / 2**30:.2f} GiB; summed RSS of {sampler.peak_processes} processes, "
            f"sampled every {args.interval:g} s, {sampler.samples} samples in {elapsed:,.0f} s); "
            f"largest single process: {largest / 2**20:,.0f} MiB",
            flush=True,
        )
    else:
        print("\npeak memory of the whole run: not measured (no /proc here)", flush=True)
    if sampler.killed:
        return 137
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
