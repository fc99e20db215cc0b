"""A DDP job on the CPU (gloo) for the process tests and ``benchmarks/lifecycle.py``: every rank logs per
step, and one rank can be made to fail as real jobs do (contract 8).

    torchrun --nproc-per-node 8 tests/ddp_fault_job.py

Environment: ``UPLOAD_MODE`` (``thread``, ``spool``), ``STEPS``, ``STEP_S`` (a step's time), ``FAULT``
(``hang``: the rank waits for ever in its data loading while the others wait for it in the gradients'
all-reduce; ``kill``: it SIGKILLs itself, as the OOM killer does; ``raise``: it raises a CUDA-like out of
memory error (``raise_once``: in torchrun's first attempt only, a restarted one resuming from
``RESUME_STEP``); ``pause``: every rank pauses ``PAUSE_S`` at ``FAULT_STEP`` (an evaluation, a checkpoint),
healthy), ``FAULT_RANK``, ``FAULT_STEP``, ``PROGRESS`` (a directory: each rank appends every step it has
logged to ``rank{r}``, so a test knows what was logged before the launcher ended it).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import instantml as im

STEPS = int(os.environ.get("STEPS", "100000"))
STEP_S = float(os.environ.get("STEP_S", "0.1"))
FAULT = os.environ.get("FAULT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "20"))
#: torchrun's restart counter: ``raise_once`` raises in the first attempt only, and a restarted attempt
#: resumes from ``RESUME_STEP`` (its checkpoint), logging again the steps after it.
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def load_batch(rank: int, step: int, shard: torch.Generator) -> torch.Tensor:
    if FAULT == "hang" and rank == FAULT_RANK and step == FAULT_STEP:
        while True:  # a data loader that never returns (a dead NFS mount, a stuck worker)
            time.sleep(0.1)
    return torch.randn(32, 16, generator=shard)


def forward(model: torch.nn.Module, x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    once = FAULT == "raise_once" and ATTEMPT == 0
    if (FAULT == "raise" or once) and rank == FAULT_RANK and step == FAULT_STEP:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.15 GiB total capacity)")
    out: torch.Tensor = model(x)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = torch.Generator().manual_seed(1000 + rank)
    progress = os.environ.get("PROGRESS")
    out = (
        os.open(os.path.join(progress, f"rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        if progress
        else -1
    )
    run = im.init(project="faults", upload_mode=os.environ.get("UPLOAD_MODE", "thread"))
    for step in range(int(os.environ.get("RESUME_STEP", "0")) if ATTEMPT else 0, STEPS):
        started = time.perf_counter()
        x = load_batch(rank, step, shard)
        loss = forward(model, x, rank, step).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here: every rank waits for every other
        optimizer.step()
        if FAULT == "pause" and step == FAULT_STEP:
            time.sleep(float(os.environ.get("PAUSE_S", "120")))
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - started)))
        run.log_rank_metrics(
            {"train/loss": loss.detach(), "system/step_time_ms": (time.perf_counter() - started) * 1000},
            step=step,
        )
        if out >= 0:
            os.write(out, f"{step}\n".encode())
        if FAULT == "kill" and rank == FAULT_RANK and step == FAULT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
