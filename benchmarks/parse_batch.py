"""CPU per event of parsing a batch request (``shared.ingest.parse.parse_batch``: JSON, validation, size
bound, digest), where the local stack's ingest workers spend most of theirs.

    .venv/bin/python -m benchmarks.parse_batch [--batches 40] [--repeats 7] [--root DIR]

The bodies are big_run's (512 ranks, 4 keys, 1,000 events a request). Each batch is parsed ``--repeats``
times and its least thread CPU time kept (the machine's other work only ever adds to it); the figure is
their sum per event. ``--root`` measures another checkout of the project (for example a worktree of an
earlier commit) on the same bodies, so two revisions can be run side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.big_run import batches

    bodies = [body() for _, body in batches("big", 512, range(args.batches * 1000 // 512 + 1))][
        : args.batches
    ]
    sys.path[0] = str(args.root.resolve())
    for name in [m for m in sys.modules if m == "shared" or m.startswith(("shared.", "instantml"))]:
        del sys.modules[name]  # big_run's imports came from this checkout
    try:
        from shared.events import RankEvent
        from shared.ingest.parse import parse_batch

        kind: Any = RankEvent
    except ImportError:  # a checkout from before models.py was split: the kind was a flag
        from shared.models import parse_batch  # type: ignore[import-not-found, no-redef]

        kind = False

    least = [float("inf")] * len(bodies)
    for _ in range(args.repeats):
        for i, body in enumerate(bodies):
            started = time.thread_time()
            parse_batch("bench", "big", body, 0.0, kind)
            least[i] = min(least[i], time.thread_time() - started)
    events = 1000 * len(bodies)
    print(
        f"parse_batch of {args.root}: {sum(least) * 1e6 / events:.1f} us of CPU per event ({events:,} events)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
