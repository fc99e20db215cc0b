"""Concurrent connections the local stack holds without a reset (issue 28's figure; goal >= 2,000).

    .venv/bin/python -m benchmarks.connections [--connections 2000]

Starts ``instantml local`` as a process of its own (a fresh data directory, 127.0.0.1, a free port),
then, from one thread, opens ``--connections`` TCP connections to it as fast as ``connect`` returns and
holds them all open at once. Only then does each send one request (``GET`` of a path with no route,
answered 404 by the HTTP front without reaching a worker process) and read its answer. A connection
counts as held when its answer arrives; a refused or reset connect, or a reset, closed or timed-out
answer, counts as lost. The stack's pid is the only process stopped.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUEST = b"GET /held HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def start_stack(data_dir: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "local", "--port", "0", "--data-dir", data_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)", first)
    if not found:
        proc.kill()
        raise SystemExit(f"the stack did not start: {first!r}")
    return proc, int(found.group(1))


def hold(port: int, count: int) -> tuple[int, int, float]:
    """(held, lost, seconds to open them all)."""
    sockets: list[socket.socket] = []
    lost = 0
    started = time.monotonic()
    for _ in range(count):
        s = socket.socket()
        s.settimeout(10)
        try:
            s.connect(("127.0.0.1", port))
            sockets.append(s)
        except OSError:
            lost += 1
            s.close()
    opened = time.monotonic() - started
    held = 0
    for s in sockets:
        try:
            s.sendall(REQUEST)
            answer = s.recv(64)
            if answer.startswith(b"HTTP/1.1 404"):
                held += 1
            else:
                lost += 1
        except OSError:
            lost += 1
        finally:
            s.close()
    return held, lost, opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.connections + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 100), hard))
    with tempfile.TemporaryDirectory() as data_dir:
        proc, port = start_stack(data_dir)
        try:
            held, lost, opened = hold(port, args.connections)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    somaxconn = Path("/proc/sys/net/core/somaxconn")
    cap = somaxconn.read_text().strip() if somaxconn.exists() else "unknown"
    print(f"net.core.somaxconn (the kernel's cap on a listen backlog): {cap}")
    print(f"opened {args.connections} connections in {opened:.2f} s")
    print(f"concurrent connections held by the local stack without a reset: {held} of {args.connections}")
    print(f"lost (refused, reset or unanswered): {lost}")


if __name__ == "__main__":
    main()
