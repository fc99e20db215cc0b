"""What the Lightning integration costs a training step, beside the same loop without it and beside
Lightning's ``WandbLogger`` (offline), in one run.

    PYTHONPATH=. .cache/venv-bench-lightning/bin/python benchmarks/lightning_overhead.py [--rounds 6]

``.cache/venv-bench-lightning`` (Python 3.11) is made by ``make bench`` from
``infra/lock/bench-lightning.txt``; any Python with torch and lightning runs it (wandb is skipped, with the
reason, where it is missing).

One process, one CPU device (the callback's work is per rank, the same on every rank), a small MLP whose
``training_step`` also sleeps ``--sleep`` seconds (0.05) so a step is about the 50 ms of a real one, and
``self.log`` of the loss at every step with ``log_every_n_steps=1`` (the loggers' worst case). Each round
fits the same model once per setup, in turn, so drift hits all of them alike:

- ``none``: no logger, no callback (``logger=False``);
- ``null-logger``: a logger that does nothing (Lightning's own per-step work for any logger: its
  metrics made Python floats, ``log_metrics`` called);
- ``instantml``: ``InstantMLLogger`` + ``InstantMLCallback`` in offline mode (the same spool appends as
  spool mode, without an uploader process competing for the 2 cores);
- ``wandb``: ``WandbLogger(offline=True)`` (rank 0's metrics only: wandb has no per-rank callback).

A step's time is from the end of the previous step to the end of this one (``on_train_batch_end``, by a
timing callback of the benchmark's own); the first ``--warmup`` steps of each fit are left out. Printed:
each setup's median step time, its overhead against ``none`` (difference of medians, and the median of
the rounds' differences), as a share of the step, and the time spent inside the integration's own code
per step (its hook methods, timed on the instances: the callback's three hooks and the logger's
``log_metrics``; for wandb its ``log_metrics``), which the scheduling noise of a shared 2-core machine
does not blur. The setups' order rotates between rounds. Goal: within 1% of a step of 50 ms or more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

FEATURES, HIDDEN, BATCH = 64, 256, 64


class StepClock(Callback):
    """The wall time between consecutive ends of a training step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def steps(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1 :], strict=False)]


class Model(L.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        time.sleep(self.hparams["sleep"])  # the rest of a real step
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(steps: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, FEATURES, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


class NullLogger(Logger):
    """A logger that does nothing: what Lightning itself does per step once any logger is attached."""

    name, version = "null", "0"

    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class HookClock:
    """Seconds spent inside the integration's own code: its hook methods, wrapped on the instances."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, obj: Any, *names: str) -> None:
        for name in names:
            inner, calls = getattr(obj, name), self.calls.setdefault(name, [])

            def timed(*args: Any, _inner: Any = inner, _calls: list[float] = calls, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    _calls.append(time.perf_counter() - started)

            setattr(obj, name, timed)

    def per_step(self) -> tuple[float, float]:
        """(the sum of each hook's median call, the mean time a step) in seconds: each hook runs once a
        step; the mean includes the first calls' one-off costs and the machine's hiccups."""
        median = sum(statistics.median(c) for c in self.calls.values() if c)
        steps = max((len(c) for c in self.calls.values()), default=0)
        return median, sum(sum(c) for c in self.calls.values()) / max(steps, 1)


def wandb_missing() -> str | None:
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        return f"wandb is not installed in {sys.prefix} ({exc})"
    return None


def fit(setup: str, steps: int, sleep: float, workdir: Path, warmup: int, hooks: HookClock) -> list[float]:
    clock = StepClock()
    logger: Any = False
    callbacks: list[Any] = [clock]
    if setup == "null-logger":
        logger = NullLogger()
    elif setup == "instantml":
        from instantml.integrations.lightning import InstantMLCallback, InstantMLLogger

        spool = str(workdir / "spool")
        logger = InstantMLLogger(project="bench", upload_mode="offline", spool_dir=spool)
        callback = InstantMLCallback()
        callbacks.append(callback)
        hooks.wrap(callback, "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")
        hooks.wrap(logger, "log_metrics")
    elif setup == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="bench", offline=True, save_dir=str(workdir))
        hooks.wrap(logger, "log_metrics")
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(sleep), loader(steps))
    if setup == "wandb":
        import wandb

        wandb.finish()
    return clock.steps(warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per fit")
    parser.add_argument("--rounds", type=int, default=6, help="fits of each setup, interleaved")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds slept in each training_step")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each fit left out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.pop("INSTANTML_RUN_ID", None)
    torch.set_num_threads(1)

    setups = ["none", "null-logger", "instantml", "wandb"]
    skipped = wandb_missing()
    if skipped:
        setups.remove("wandb")
    times: dict[str, list[float]] = {s: [] for s in setups}
    medians: dict[str, list[float]] = {s: [] for s in setups}
    hooks = {s: HookClock() for s in setups}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setup in setups[round_ % len(setups) :] + setups[: round_ % len(setups)]:  # rotated
                workdir = Path(tmp) / f"{setup}-{round_}"
                got = fit(setup, args.steps, args.sleep, workdir, args.warmup, hooks[setup])
                times[setup] += got
                medians[setup].append(statistics.median(got))

    import lightning

    print(
        f"Lightning {lightning.__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}: "
        f"{args.rounds} rounds x {args.steps} steps per setup ({args.warmup} warm-up steps left out), "
        f"training_step sleeps {args.sleep * 1e3:.0f} ms, log_every_n_steps=1, 1 CPU device"
    )
    base = statistics.median(times["none"])
    print(
        f"{'setup':<11} {'steps':>5} {'median step':>12} {'overhead':>10} {'share':>7} {'per round':>10}"
        f" {'in its hooks: median':>21} {'share':>7} {'mean':>10}"
    )
    for setup in setups:
        median = statistics.median(times[setup])
        per_round = statistics.median(m - b for m, b in zip(medians[setup], medians["none"], strict=True))
        inside, mean = hooks[setup].per_step()
        print(
            f"{setup:<11} {len(times[setup]):>5} {median * 1e3:>9.3f} ms {(median - base) * 1e3:>+7.3f} ms "
            f"{(median - base) / base:>+7.2%} {per_round * 1e3:>+7.3f} ms {inside * 1e3:>18.3f} ms "
            f"{inside / base:>7.2%} {mean * 1e3:>7.3f} ms"
        )
    if skipped:
        print(f"wandb: skipped, {skipped}")
    overhead = (statistics.median(times["instantml"]) - base) / base
    beside_null = (statistics.median(times["instantml"]) - statistics.median(times["null-logger"])) / base
    inside = hooks["instantml"].per_step()[0] / base
    print(
        f"instantml logger + callback: {overhead:+.2%} of a step by the step medians ({beside_null:+.2%} "
        f"beside a logger that does nothing), {inside:.2%} by the time in its own hooks (goal: within 1%)"
    )


if __name__ == "__main__":
    main()
