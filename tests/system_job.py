"""One rank of a plain multi-process job (no torch) for the system metrics' tests and benchmark: run as
``python -m tests.system_job`` with ``RANK`` and ``WORLD_SIZE`` set, it logs ``train/loss`` for ``STEPS``
steps ``STEP_S`` apart in thread mode; the rank ``LEAK_RANK`` keeps ``LEAK_MB`` MiB more each step (a
leak), and with ``EVAL_EVERY`` rank 0 holds ``EVAL_MB`` MiB for a fifth of every such stretch (its
evaluation, freed after). The process's own sampling (``INSTANTML_SYSTEM_INTERVAL_S``) does the rest."""

from __future__ import annotations

import math
import os
import time

import instantml as im


def main() -> None:
    rank, steps = int(os.environ["RANK"]), int(os.environ.get("STEPS", "300"))
    step_s = float(os.environ.get("STEP_S", "0.02"))
    leak_rank = int(os.environ.get("LEAK_RANK", "-1"))
    leak = int(float(os.environ.get("LEAK_MB", "0")) * (1 << 20))
    eval_every, eval_mb = int(os.environ.get("EVAL_EVERY", "0")), int(os.environ.get("EVAL_MB", "0"))
    run = im.init(project=os.environ["PROJECT"], run_id=os.environ["RUN_ID"])
    kept: list[bytes] = []
    held: bytes | None = None
    started = time.monotonic()
    for step in range(steps):
        if rank == leak_rank:
            kept.append(b"\x01" * leak)  # (written: resident)
        if eval_every and rank == 0:
            evaluating = step % eval_every >= eval_every * 4 // 5
            held = (held or b"\x01" * (eval_mb << 20)) if evaluating else None
        run.log_rank_metrics({"train/loss": 2.0 * math.exp(-step / 200) + 0.01 * rank}, step=step)
        time.sleep(max(0.0, started + (step + 1) * step_s - time.monotonic()))
    run.finish()


if __name__ == "__main__":
    main()
