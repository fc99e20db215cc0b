"""PyTorch Lightning DDP on the CPU with InstantML's logger and per-rank callback.

    pip install 'instantml[lightning]'
    export INSTANTML_API_URL=http://127.0.0.1:8787 INSTANTML_API_KEY=<token>   # from `instantml local`
    python examples/lightning_ddp.py                                  # 2 ranks: Lightning starts rank 1
    SLOW_RANK=1 SLOW_SECONDS=0.05 DEVICES=4 python examples/lightning_ddp.py     # rank 1 a straggler

A tiny regression model on random data, ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``. The
two lines that matter are the trainer's ``logger=`` and ``callbacks=``:

- ``InstantMLLogger`` (rank 0) records what ``self.log`` logs, here the loss reduced across ranks
  (``sync_dist=True``), with ``run.log``, and the hyperparameters of ``save_hyperparameters()`` as the
  run's config;
- ``InstantMLCallback`` (every rank) records each rank's own loss, data time, step time and grad norm,
  with its batch size as the weight, for the Distributed tab.

Each rank trains on its own part of the data (Lightning's ``DistributedSampler``), so the ranks' losses
differ. Knobs, by environment variable: ``DEVICES`` (2), ``STEPS`` (30), ``PROJECT`` (lightning-ddp),
``SLOW_RANK`` and ``SLOW_SECONDS`` (0.05; that rank's data loading sleeps that long per batch, as a rank
reading from slow storage would) and ``STEP_SECONDS`` (0; a sleep in every ``training_step``, for the
benchmark's longer steps). No run id is set anywhere: every rank gets the same one (see
``instantml.integrations.lightning``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from instantml.integrations.lightning import InstantMLCallback, InstantMLLogger

DEVICES = int(os.environ.get("DEVICES", "2"))
STEPS = int(os.environ.get("STEPS", "30"))
PROJECT = os.environ.get("PROJECT", "lightning-ddp")
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_SECONDS = float(os.environ.get("SLOW_SECONDS", "0.05"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0"))
FEATURES = 16
BATCH_SIZE = 32


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The default collation, slowed down on ``SLOW_RANK`` (this runs inside the rank's data loading)."""
    if SLOW_RANK >= 0 and torch.distributed.is_initialized() and torch.distributed.get_rank() == SLOW_RANK:
        time.sleep(SLOW_SECONDS)
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


class Regression(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 32, step_seconds: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()  # the logger records these as the run's config
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        if self.hparams["step_seconds"]:
            time.sleep(self.hparams["step_seconds"])
        # The trainer's view: the mean over the ranks. The callback logs each rank's own loss.
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def data() -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    samples = STEPS * BATCH_SIZE * DEVICES
    x = torch.randn(samples, FEATURES, generator=generator)
    y = (x @ torch.linspace(-1, 1, FEATURES) + 0.1 * torch.randn(samples, generator=generator)).unsqueeze(1)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True, collate_fn=collate)


def main() -> None:
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy="ddp",
        max_steps=STEPS,
        log_every_n_steps=1,
        logger=InstantMLLogger(project=PROJECT),
        callbacks=[InstantMLCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(step_seconds=STEP_SECONDS), data())


if __name__ == "__main__":
    main()
