"""A DDP job on the CPU (gloo) whose ranks can be made faulty, for the Distributed tab to find.

    export INSTANTML_API_URL=http://127.0.0.1:8787 INSTANTML_API_KEY=<token>
    torchrun --nproc-per-node 8 examples/ddp_faults.py                                   # clean
    SLOW_RANK=3 SLOW_SECONDS=0.05 torchrun --nproc-per-node 8 examples/ddp_faults.py     # a straggler
    BAD_SHARD_RANK=5 torchrun --nproc-per-node 8 examples/ddp_faults.py                  # a bad shard

Each rank trains on its own shard of a synthetic regression data set and logs, at every step:

- ``train/loss``: its own loss on its own batch;
- ``optimizer/grad_norm``: the norm of the gradients after DDP's all-reduce (the same on every rank);
- ``system/data_time``: seconds spent loading its own batch (fetching and collating samples), measured
  inside its data loading, so it never includes waiting for other ranks;
- ``system/compute_time``: seconds of forward, backward and optimizer step, which includes waiting at
  the gradient all-reduce for the slowest rank;

with its batch size as the weight. Faults, by environment variable (none: a clean run):

- ``SLOW_RANK`` (and ``SLOW_SECONDS``, default 0.05): that rank's data loading sleeps that long per
  batch, like a rank reading from slow storage. The others then wait for it at the all-reduce.
- ``BAD_SHARD_RANK``: that rank's shard has its labels shuffled, so they no longer match the inputs
  and its loss stays clearly above the others' while they learn.

``STEPS`` (default 60) sets the length. Every rank gets the same run id from torchrun inside
``im.init``; the training processes only append to their spool files and one uploader sends them.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import instantml as im

STEPS = int(os.environ.get("STEPS", "60"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_SECONDS = float(os.environ.get("SLOW_SECONDS", "0.05"))
BAD_SHARD_RANK = int(os.environ.get("BAD_SHARD_RANK", "-1"))

FEATURES = 16
BATCH_SIZE = 32
SHARD_SIZE = 16 * BATCH_SIZE


class Shard:
    """This rank's part of the data set: ``y = x . target + noise``, the same function on every rank."""

    def __init__(self, rank: int, bad: bool) -> None:
        generator = torch.Generator().manual_seed(1000 + rank)
        target = torch.linspace(-1, 1, FEATURES)
        self.x = torch.randn(SHARD_SIZE, FEATURES, generator=generator)
        self.y = self.x @ target + 0.1 * torch.randn(SHARD_SIZE, generator=generator)
        if bad:  # a corrupted shard: every label belongs to some other sample
            self.y = self.y[torch.randperm(SHARD_SIZE, generator=generator)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def load_batch(shard: Shard, step: int, slow_seconds: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The step's batch (fetched sample by sample, then collated) and the seconds it took."""
    started = time.perf_counter()
    if slow_seconds:
        time.sleep(slow_seconds)  # slow storage on this rank only
    first = step * BATCH_SIZE % SHARD_SIZE
    samples = [shard[i] for i in range(first, first + BATCH_SIZE)]
    x = torch.stack([sample[0] for sample in samples])
    y = torch.stack([sample[1] for sample in samples]).unsqueeze(1)
    return x, y, time.perf_counter() - started


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shard = Shard(rank, bad=rank == BAD_SHARD_RANK)
    slow_seconds = SLOW_SECONDS if rank == SLOW_RANK else 0.0

    with im.init(project="ddp-faults", upload_mode="spool") as run:
        for step in range(STEPS):
            x, y, data_time = load_batch(shard, step, slow_seconds)
            started = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here: a fast rank waits for the slowest
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=100.0)
            optimizer.step()
            compute_time = time.perf_counter() - started
            run.log_rank_metrics(
                {
                    "train/loss": loss.detach(),
                    "optimizer/grad_norm": grad_norm,
                    "system/data_time": data_time,
                    "system/compute_time": compute_time,
                },
                step=step,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                weight=BATCH_SIZE,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
