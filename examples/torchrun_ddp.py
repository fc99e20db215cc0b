"""A small DDP job on the CPU (gloo backend) that logs per-rank metrics from every rank in spool mode,
and the run's ordinary scalars (the all-reduced loss, the learning rate) from rank 0 with ``run.log``.

    export INSTANTML_API_URL=http://127.0.0.1:8787 INSTANTML_API_KEY=<token>
    torchrun --nproc-per-node 4 examples/torchrun_ddp.py

Every rank gets the same run id from torchrun (TORCHELASTIC_RUN_ID) inside ``im.init``, and its rank,
world size and local rank from torchrun's RANK, WORLD_SIZE and LOCAL_RANK: nothing here passes them.
The training processes only append to their spool files; one uploader process sends them.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import instantml as im

STEPS = int(os.environ.get("STEPS", "50"))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    lr = 0.01
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    shard = torch.Generator().manual_seed(1000 + rank)  # each rank reads its own data shard
    batch_size = 32
    target = torch.linspace(-1, 1, 16)
    config = {"model": "mlp-16-64-1", "optimizer": "SGD", "lr": lr, "batch_size": batch_size, "steps": STEPS}

    with im.init(project="torchrun-ddp", upload_mode="spool", config=config) as run:
        for step in range(STEPS):
            started = time.perf_counter()
            x = torch.randn(batch_size, 16, generator=shard)
            y = (x @ target).unsqueeze(1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=100.0)
            optimizer.step()
            run.log_rank_metrics(
                {
                    "train/loss": loss.detach(),  # a 0-d tensor: converted with float()
                    "optimizer/grad_norm": grad_norm,
                    "system/step_time_ms": (time.perf_counter() - started) * 1000,
                },
                step=step,
                weight=batch_size,
            )
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # every rank takes part; rank 0 logs the job's mean loss
            if rank == 0:
                run.log(
                    {"train/loss": mean_loss / dist.get_world_size(), "lr": optimizer.param_groups[0]["lr"]},
                    step=step,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
