"""PyTorch Lightning: a ``Logger`` for the run's ordinary metrics and hyperparameters, and a ``Callback``
that logs every rank's own values.

    from instantml.integrations.lightning import InstantMLCallback, InstantMLLogger

    trainer = Trainer(logger=InstantMLLogger(project="my-job"), callbacks=[InstantMLCallback()], ...)

``pip install 'instantml[lightning]'``. What each logs:

- :class:`InstantMLLogger`, on rank 0 as Lightning's loggers are: what the trainer logs (``self.log``,
  after any ``sync_dist`` reduction) with ``run.log`` at Lightning's step, and the hyperparameters
  (``save_hyperparameters()``, ``log_hyperparams``) as the run's config.
- :class:`InstantMLCallback`, on every rank, with ``run.log_rank_metrics`` at the same step as the
  logger's: the rank's own loss (``train/loss``, what its ``training_step`` returned, before any
  cross-rank reduction); its data time (``system/data_time``: seconds inside its own
  ``next(dataloader)``, which never waits for other ranks); its step time (``system/step_time``: from
  the end of its previous step to the end of this one, everything the step took, data loading and
  waiting at the collectives included); the grad norm (``optimizer/grad_norm``: the total 2-norm of its
  gradients after DDP's all-reduce, before clipping); and its batch's number of samples as the weight
  (tokens, the sum of ``attention_mask``, when the batch is a mapping that has one).

Both share one run in a process: the callback logs through the logger's run when the trainer has an
``InstantMLLogger``, else through a run of its own.

One run id for every rank, without coordination: an explicit ``run_id``, else ``INSTANTML_RUN_ID``, else
the launcher's job id (torchrun, SLURM, ...), as ``im.init`` resolves it. Lightning's own DDP launcher
(``strategy="ddp"`` started with ``python train.py``) sets no job id: it starts the other ranks as copies
of the script with a copy of its environment. So when no id is in the environment, the logger (or the
callback), made before ``trainer.fit``, puts the fresh id it drew into ``INSTANTML_RUN_ID`` of its own
process, and every rank Lightning starts inherits it. The id is let go when the run is finished, so a
second ``fit`` with new loggers in the same process gets a new one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

from instantml.integrations import DATA_TIME, GRAD_NORM, LOSS, STEP_TIME, require

require("lightning", "lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402

import instantml as im  # noqa: E402
from instantml import limits, settings  # noqa: E402
from instantml.run import RUN_ID_VARIABLES, UPLOAD_MODES, Run, resolve_run_id  # noqa: E402

__all__ = ["DEFAULT_PROJECT", "InstantMLCallback", "InstantMLLogger"]

DEFAULT_PROJECT = "lightning"
#: Lightning's training loop wraps each ``next()`` of the rank's train dataloader in
#: ``trainer.profiler.start/stop("[_TrainingEpochLoop].train_dataloader_next")``, on that rank alone.
FETCH_ACTION = "train_dataloader_next"

#: The run id this process put into ``INSTANTML_RUN_ID`` for the ranks Lightning starts (None: none).
_exported: str | None = None


def agreed_run_id(run_id: str | None = None) -> str:
    """The run id for a run made in this process, the same in every rank of the job (module docstring)."""
    global _exported
    if run_id is not None:
        return resolve_run_id(run_id)
    environ = dict(os.environ)
    if any(environ.get(name, "").strip().lower() not in ("", "none") for name in RUN_ID_VARIABLES):
        return resolve_run_id(None, environ)
    _exported = resolve_run_id(None, environ)  # a fresh id: hand it to the ranks Lightning will start
    os.environ[settings.RUN_ID_ENV] = _exported
    return _exported


def _release(run_id: str) -> None:
    """Forget the id this process exported for ``run_id``'s run, once that run is finished."""
    global _exported
    if _exported == run_id:
        if os.environ.get(settings.RUN_ID_ENV) == run_id:
            del os.environ[settings.RUN_ID_ENV]
        _exported = None


class _Lazy:
    """A run made at first use (in the rank's own process, after Lightning started it), closed once."""

    def __init__(self, project: str | None, run_id: str | None, upload_mode: str, init: dict[str, Any]):
        self.project = limits.check_name(
            "project", project or os.environ.get(settings.PROJECT_ENV) or DEFAULT_PROJECT
        )
        if upload_mode not in UPLOAD_MODES:  # im.init runs later, in each rank: say it now
            raise ValueError(f"upload_mode: must be one of {', '.join(UPLOAD_MODES)}, got {upload_mode!r}")
        self.run_id = agreed_run_id(run_id)
        self.upload_mode = upload_mode
        self.init = init
        self.run: Run | None = None

    def get(self) -> Run:
        if self.run is None:
            self.run = im.init(self.project, self.run_id, upload_mode=self.upload_mode, **self.init)
        return self.run

    def close(self, success: bool) -> None:
        """Finish the run (a failed fit leaves it unfinished: it shows as idle, not finished)."""
        run, self.run = self.run, None
        if run is not None:
            if success:
                run.finish()
            else:
                run._close(30.0, mark_finished=False)
        _release(self.run_id)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the trainer's loggers and callbacks
        return {**self.__dict__, "run": None}


class InstantMLLogger(Logger):  # type: ignore[misc]
    """A Lightning ``Logger``: the trainer's metrics with ``run.log`` and its hyperparameters as the
    run's config, from rank 0 (module docstring). ``**init_kwargs`` go to ``im.init`` (``api_url``,
    ``api_key``, ``spool_dir``, ``config``, ...)."""

    def __init__(
        self,
        project: str | None = None,
        run_id: str | None = None,
        upload_mode: str = "spool",
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        self._lazy = _Lazy(project, run_id, upload_mode, init_kwargs)
        self._config: dict[str, Any] = dict(init_kwargs.get("config") or {})

    @property
    def name(self) -> str:
        return self._lazy.project

    @property
    def version(self) -> str:
        return self._lazy.run_id

    @property
    def run(self) -> Run:
        """This process's run (made at first use)."""
        return self._lazy.get()

    @property
    def experiment(self) -> Run:
        return self._lazy.get()

    @rank_zero_only  # type: ignore[untyped-decorator]
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Merge ``params`` (a dict, ``Namespace`` or Lightning's ``AttributeDict``) into the run's config
        and send the whole config again (the last one sent is the run's)."""
        if params is None:
            return
        self._config.update(vars(params) if not isinstance(params, Mapping) else dict(params))
        self.run.set_config(self._config)

    @rank_zero_only  # type: ignore[untyped-decorator]
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.run.log(dict(metrics), step)

    def finalize(self, status: str) -> None:
        """Close this process's run (every rank's: its events reach the server); rank 0 marks it
        finished when the fit succeeded."""
        self._lazy.close(success=status == "success")


class _FetchTimer:
    """Seconds this rank spent in ``next()`` of its train dataloader, from Lightning's own profiler calls
    around it (``FETCH_ACTION``): the instance's ``start``/``stop`` are wrapped, whatever profiler it is."""

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler
        self.inner_start, self.inner_stop = profiler.start, profiler.stop
        self.started: float | None = None
        self.total = 0.0
        self.seen = False  # a fetch was timed: this Lightning calls the profiler as expected
        profiler.start, profiler.stop = self.start, self.stop

    def start(self, action: str) -> None:
        self.inner_start(action)
        if action.endswith(FETCH_ACTION):
            self.started = time.perf_counter()

    def stop(self, action: str) -> None:
        if self.started is not None and action.endswith(FETCH_ACTION):
            self.total += time.perf_counter() - self.started
            self.started = None
            self.seen = True
        self.inner_stop(action)

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total

    def remove(self) -> None:
        for name in ("start", "stop"):
            if self.profiler.__dict__.get(name) == getattr(self, name):
                delattr(self.profiler, name)


def batch_weight(batch: Any) -> float:
    """The weight of a rank's batch: its tokens (``attention_mask`` summed) when it is a mapping that has
    an attention mask, else its number of samples (Lightning's own inference of the batch size)."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return float(mask.sum())
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim():  # the common (inputs, targets): no tree walk
        return float(len(first))
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return float(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - a batch Lightning cannot size counts as one
        return 1.0


def _loss(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    return None


class InstantMLCallback(Callback):  # type: ignore[misc]
    """A Lightning ``Callback`` that logs, on every rank and at every optimizer step, that rank's own loss,
    data time, step time, grad norm and batch size (module docstring). With an :class:`InstantMLLogger`
    in the trainer it logs through the logger's run (``project``, ``run_id`` and ``**init_kwargs`` are then
    unused), else through its own. ``grad_norm=False`` skips the grad norm (one pass over the gradients
    per step)."""

    def __init__(
        self,
        project: str | None = None,
        run_id: str | None = None,
        upload_mode: str = "spool",
        grad_norm: bool = True,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        self._own = _Lazy(project, run_id, upload_mode, init_kwargs)
        self._grad_norm_wanted = grad_norm
        self._lazy: _Lazy | None = None
        self._timer: _FetchTimer | None = None
        self._reset()

    def _reset(self) -> None:
        self._last_end: float | None = None
        self._data = 0.0  # this batch's fetch
        self._grad_norm: float | None = None
        # Sums over the micro-batches of one optimizer step (one, without gradient accumulation).
        self._loss_sum = self._loss_weight = self._weight = 0.0
        self._data_sum = self._step_sum = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_timer": None, "_lazy": None}

    @property
    def run(self) -> Run:
        """The run this callback logs through in this process."""
        return (self._lazy or self._own).get()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, InstantMLLogger)), None)
        self._lazy = logger._lazy if logger is not None else self._own
        self._lazy.get()  # every rank's run, before the first step
        self._timer = _FetchTimer(trainer.profiler)
        self._reset()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self._timer is not None:
            self._timer.remove()
            self._timer = None
        if self._lazy is self._own:  # a logger's run is the logger's to finish (finalize)
            self._own.close(success=not trainer.interrupted)
        self._lazy = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._lazy is self._own:
            self._own.close(success=False)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        timer = self._timer
        if timer is not None and timer.seen:
            self._data = timer.take()
        else:  # a Lightning that times its fetch otherwise: the time since the last step (waits included)
            self._data = 0.0 if self._last_end is None else now - self._last_end
        if self._last_end is None:  # the fit's first step starts with its fetch
            self._last_end = now - self._data

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._grad_norm_wanted:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            with torch.no_grad():
                norms = torch._foreach_norm(grads, 2.0)  # one kernel per dtype and device, not per tensor
                self._grad_norm = float(torch.linalg.vector_norm(torch.stack(norms), 2.0))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        # The whole step since the previous one ended: Lightning's own work between steps (on DDP a
        # broadcast from rank 0 that returns early on rank 0 alone) would make a window from
        # on_train_batch_start differ between ranks by a steady millisecond or so.
        self._step_sum += now - (self._last_end if self._last_end is not None else now)
        self._last_end = now
        weight = batch_weight(batch)
        loss = _loss(outputs)
        if loss is not None:
            if pl_module.automatic_optimization:  # Lightning divided it by the accumulation steps
                loss *= trainer.accumulate_grad_batches
            self._loss_sum += loss * weight
            self._loss_weight += weight
        self._weight += weight
        self._data_sum += self._data
        loop = trainer.fit_loop.epoch_loop
        with contextlib.suppress(AttributeError):  # Lightning's private loop state; else log every batch
            if loop._should_accumulate():
                return
        # The logger's step for this batch (Lightning counts it up after this hook).
        step = getattr(loop, "_batches_that_stepped", trainer.global_step)
        metrics = {DATA_TIME: self._data_sum, STEP_TIME: self._step_sum}
        if self._loss_weight:
            metrics[LOSS] = self._loss_sum / self._loss_weight
        if self._grad_norm is not None:
            metrics[GRAD_NORM] = self._grad_norm
        assert self._lazy is not None, "InstantMLCallback.setup was not called"
        self._lazy.get().log_rank_metrics(
            metrics,
            step=step,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
            weight=self._weight or 1.0,
        )
        self._grad_norm = None
        self._loss_sum = self._loss_weight = self._weight = 0.0
        self._data_sum = self._step_sum = 0.0
