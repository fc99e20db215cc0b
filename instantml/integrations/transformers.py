"""The Hugging Face ``Trainer`` callback: every rank's own values, and what the trainer logs.

    from instantml.integrations.transformers import InstantMLCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[InstantMLCallback()])

Launched with torchrun (or accelerate, DeepSpeed, SLURM), every rank joins the same run without any
coordination: ``im.init`` takes the run id from ``INSTANTML_RUN_ID``, else the launcher's job id
(``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``, ...). ``pip install 'instantml[transformers]'``.

What each rank logs with ``run.log_rank_metrics``, once per optimizer step (``state.global_step``), with
the keys the trainer integrations share (:mod:`instantml.integrations`):

- ``train/loss``: this rank's own loss, before the trainer gathers and averages it across ranks: what the
  Trainer's ``training_step`` returned on this rank, summed over the step's gradient-accumulation
  micro-batches, exactly the term the trainer averages over ranks for its logged ``loss``. (With
  ``average_tokens_across_devices``, the default, a model that normalises its loss by token count is
  normalised by the tokens of *all* ranks and scaled by the world size, so a rank with fewer tokens than
  the others reports proportionally less; ``average_tokens_across_devices=False`` makes it this rank's
  own mean over its own tokens.)
- ``optimizer/grad_norm``: the gradient norm the trainer computed for clipping on this rank (after DDP's
  all-reduce it is the same on every rank; a rank that differs is out of sync).
- ``system/data_time``: seconds this rank's data collator took to make the step's batches (each batch's
  own collation, whenever the loader prefetched it). The rank's own time is measured inside its data
  loading, because around the step it would include waiting: in transformers 5 every rank waits for the
  slowest while it fetches a batch (the trainer gathers the batch's token count from all ranks there).
  Reads of samples outside the collator (``dataset[i]``) are not in it; with
  ``dataloader_num_workers > 0`` collation happens in worker processes, which this process cannot time,
  and the key is left out (as it is on ranks that never collate: with an iterable dataset accelerate
  collates on rank 0 and sends the batches to the others).
- ``system/step_time``: seconds from the end of this rank's previous step (or the start of training) to
  the end of this one: data, compute, waiting at the collectives, and whatever the trainer did between
  (its logging, evaluation, checkpoints). A window that started at the batch fetch would leave rank 0's
  logging out of its own step but put it into the others' (they wait for rank 0 at the next collective),
  making rank 0 look steadily faster in a clean run.
- weight: the step's number of non-padding tokens (``attention_mask``; all of ``input_ids`` without a
  mask), else its number of samples.

From the main process (rank 0) it logs what the trainer logs (``on_log``: loss, learning rate, grad
norm, eval metrics, ...) with ``run.log`` at ``state.global_step``, named as wandb names them
(``train/loss``, ``eval/loss``), and records ``TrainingArguments.to_dict()`` and the model's
``config.to_dict()`` as the run's config (``{"training_args": ..., "model_config": ...}``, long values
trimmed to fit the 64 KiB limit). At the end of training every rank closes its run; rank 0's marks it
finished.

How it sees per-rank values. A ``TrainerCallback`` is handed the model, optimizer and data loaders but
neither the trainer nor the loss of a step, and the trainer keeps its per-rank loss in a private
accumulator that it resets whenever it logs. So when the trainer first calls this callback
(``on_init_end``, from ``Trainer.__init__``, or ``on_train_begin`` for a callback added later), the
callback finds that trainer on the call stack (the ``Trainer`` whose callback handler holds it) and wraps
two of its methods on that instance only: ``training_step`` (the loss it returns and the batch it was
given) and ``_get_grad_norm`` (the norm the trainer computed; absent in other versions, then the key is
left out). The training data loader's ``collate_fn`` is wrapped at ``on_train_begin``, so evaluation
batches never count as training data time. Nothing makes the host wait for the device where the trainer
does not already: the loss, grad norm and token count stay tensors (two tiny on-device sums per
micro-batch) until the trainer itself synchronises with the host when it logs (its all-gather of the
loss, every ``logging_steps``), or after 500 steps, and only then become numbers for
``log_rank_metrics``; on the CPU, where no such wait exists, they are logged at every step. The events go
through the client's own path (spool mode by default: the training process only appends to its spool
file).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

from instantml.integrations import DATA_TIME, GRAD_NORM, LOSS, STEP_TIME, require

require("transformers", "transformers")

import transformers  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

import instantml as im  # noqa: E402
from instantml import limits, settings  # noqa: E402
from instantml.run import _config_value  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "huggingface"
#: How many frames up from a callback hook to look for the trainer calling it.
_STACK_DEPTH = 8
#: A string in the config longer than this is cut when the config is over the size limit.
_LONG_STRING = 256
#: ... and a list longer than this.
_LONG_LIST = 32
#: Steps kept as device tensors at most, when the trainer logs seldom (``logging_steps``) or never.
_MAX_PENDING_STEPS = 500
#: Collated batches not yet trained on that the collator remembers (the loader prefetches one or two).
_MAX_QUEUED_BATCHES = 64


def trimmed_config(config: dict[str, Any], limit: int = limits.MAX_CONFIG_BYTES) -> dict[str, Any]:
    """``config`` made JSON-ready and, when it is more than ``limit`` bytes as compact JSON, trimmed to fit:
    long strings and lists are cut first, then the largest values are replaced by a note of their size,
    largest first, then (a config of very many small values) whole sections.

    >>> trimmed_config({"a": "x" * 1000, "b": 1}, limit=400)["a"][-31:]
    '... (1,000 characters, trimmed)'
    >>> trimmed_config({"a": "x" * 1000, "b": 1}, limit=100)
    {'a': '<trimmed: 289 bytes>', 'b': 1}
    >>> trimmed_config({"m": {"n_layer": 2, "id2label": {str(i): "label" for i in range(999)}}}, limit=100)
    {'m': {'n_layer': 2, 'id2label': '<trimmed: 13,877 bytes>'}}
    """
    clean: dict[str, Any] = _config_value(config, "config", 0)
    total = _size(clean)
    if total <= limit:
        return clean
    clean = _cut(clean)
    total = _size(clean)
    for path, size in sorted(_leaves(clean, ()), key=lambda leaf: -leaf[1]):
        if total <= limit:
            break
        note = f"<trimmed: {size:,} bytes>"
        if size <= len(note) + 2:
            break
        parent = clean
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = note
        total -= size - (len(note) + 2)
    while _size(clean) > limit:  # many small values: the dict that holds most of them
        parent, key = clean, max(clean, key=lambda k: _size(clean[k]))
        while isinstance(parent[key], dict) and parent[key]:
            inner = max(parent[key], key=lambda k: _size(parent[key][k]))
            if _size(parent[key][inner]) * 2 < _size(parent[key]):
                break
            parent, key = parent[key], inner
        if isinstance(parent[key], str) and parent[key].startswith("<trimmed"):
            return {"trimmed": f"the config was {_size(clean):,} bytes as JSON, over the limit"}
        parent[key] = f"<trimmed: {_size(parent[key]):,} bytes>"
    return clean


def _size(value: Any) -> int:
    return len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > _LONG_STRING:
        return value[:_LONG_STRING] + f"... ({len(value):,} characters, trimmed)"
    if isinstance(value, list):
        kept = [_cut(v) for v in value[:_LONG_LIST]]
        if len(value) > _LONG_LIST:
            kept.append(f"... ({len(value):,} items, trimmed)")
        return kept
    if isinstance(value, dict):
        return {k: _cut(v) for k, v in value.items()}
    return value


def _leaves(value: dict[str, Any], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], int]]:
    """Every value that is not a dict, with its path and size as JSON."""
    found: list[tuple[tuple[str, ...], int]] = []
    for key, item in value.items():
        if isinstance(item, dict) and item:
            found.extend(_leaves(item, (*path, key)))
        else:
            found.append(((*path, key), _size(item)))
    return found


def _numbers(logs: dict[str, Any]) -> dict[str, float]:
    """The trainer's logs as ``run.log`` scalars, named as wandb names them (``eval_loss``: ``eval/loss``,
    ``loss``: ``train/loss``); strings and other non-numbers are left out."""
    values: dict[str, float] = {}
    for key, item in logs.items():
        value: Any = item
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for prefix in ("eval", "test"):
            if key.startswith(prefix + "_"):
                name = f"{prefix}/{key[len(prefix) + 1 :]}"
                break
        else:
            name = f"train/{key}"
        values[name] = value
    return values


class _TimedCollator:
    """A data collator that queues the seconds each call takes, one entry per batch, oldest first: the
    trainer trains on batches in the order they were collated, whatever the loader prefetches (accelerate
    collates the next batch before it hands over the current one)."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate
        self.durations: deque[float] = deque(maxlen=_MAX_QUEUED_BATCHES)

    def __call__(self, samples: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.collate(samples)
        finally:
            self.durations.append(time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:  # attributes of the user's collator stay reachable
        if name == "collate":
            raise AttributeError(name)
        return getattr(self.collate, name)


def _batch_weight(inputs: Any) -> Any:
    """Non-padding tokens of a batch (a 0-d tensor: no wait for the device), else its number of samples."""
    if isinstance(inputs, dict) or hasattr(inputs, "keys"):
        mask = inputs.get("attention_mask")
        if mask is not None and hasattr(mask, "sum"):
            return mask.sum()
        ids = inputs.get("input_ids")
        if ids is not None and hasattr(ids, "numel"):
            return ids.numel()
        for value in inputs.values():
            if hasattr(value, "shape") and len(value.shape) > 0:
                return int(value.shape[0])
    return 1


class InstantMLCallback(transformers.TrainerCallback):  # type: ignore[misc, unused-ignore]
    """Log each rank's own loss, grad norm, data and step times to InstantML, and the trainer's logs and
    config from rank 0. ``project`` defaults to ``INSTANTML_PROJECT``, else ``"huggingface"``; ``run_id``
    to the launcher's job id (``im.init``'s rules); other keyword arguments go to ``im.init``."""

    def __init__(
        self,
        project: str | None = None,
        run_id: str | None = None,
        upload_mode: str = "spool",
        **init_kwargs: Any,
    ) -> None:
        self.project = project or os.environ.get(settings.PROJECT_ENV) or DEFAULT_PROJECT
        limits.check_name("project", self.project)
        self._run_id = run_id
        self.upload_mode = upload_mode
        # The user's own config goes beside the trainer's, once, from rank 0 (not to every im.init).
        self._config = dict(init_kwargs.pop("config", None) or {})
        self.init_kwargs = init_kwargs
        self.run: im.Run | None = None
        self._trainer: Any = None
        self._collator: _TimedCollator | None = None
        self._to_host = False  # log at every step (CPU) or when the trainer logs (accelerators)
        # The step being measured: loss and weight tensors summed over its micro-batches.
        self._last_step_end: float | None = None
        self._loss: Any = None
        self._weight: Any = None
        self._grad_norm: Any = None
        self._data_time: float | None = 0.0
        #: Steps measured but not yet logged: (step, loss, grad norm, data time, step time, weight).
        self._pending: list[tuple[int, Any, Any, float | None, float, Any]] = []

    # -- finding the trainer -------------------------------------------------------------------------

    def _find_trainer(self) -> None:
        if self._trainer is not None:
            return
        frame: FrameType | None = sys._getframe(2)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if isinstance(candidate, transformers.Trainer) and self in getattr(handler, "callbacks", ()):
                self.attach(candidate)
                return
            frame = frame.f_back
        log.warning(
            "InstantMLCallback could not find its Trainer: the per-rank loss, grad norm and step time "
            "are not logged (call callback.attach(trainer) before trainer.train())"
        )

    def attach(self, trainer: Any) -> None:
        """Observe ``trainer`` (found by itself; call this only for a trainer it did not find). Wraps the
        trainer instance's ``training_step`` and ``_get_grad_norm``, once."""
        if self._trainer is not None:
            return
        self._trainer = trainer
        training_step = trainer.training_step

        def observed_training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            weight = _batch_weight(inputs)
            durations = self._collator.durations if self._collator is not None else None
            if durations and self._data_time is not None:
                self._data_time += durations.popleft()  # this batch's own collation
            else:
                self._data_time = None  # (not collated here: another process's loader, or workers)
            loss = training_step(model, inputs, *args, **kwargs)
            # On-device sums: no wait for the device here.
            self._loss = loss if self._loss is None else self._loss + loss
            self._weight = weight if self._weight is None else self._weight + weight
            return loss

        trainer.training_step = observed_training_step
        get_grad_norm = getattr(trainer, "_get_grad_norm", None)
        if get_grad_norm is not None:

            def observed_get_grad_norm(*args: Any, **kwargs: Any) -> Any:
                self._grad_norm = get_grad_norm(*args, **kwargs)
                return self._grad_norm

            trainer._get_grad_norm = observed_get_grad_norm

    # -- the trainer's events ------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._find_trainer()
        self._to_host = getattr(args.device, "type", "cpu") == "cpu"
        loader = kwargs.get("train_dataloader")
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps a DataLoader
        self._collator = None
        if base is not None and getattr(base, "num_workers", 0) == 0 and callable(base.collate_fn):
            if not isinstance(base.collate_fn, _TimedCollator):
                base.collate_fn = _TimedCollator(base.collate_fn)
            self._collator = base.collate_fn
            self._collator.durations.clear()
        config = None
        if state.is_world_process_zero:
            config = {**self._config, "training_args": args.to_dict()}
            model_config = getattr(kwargs.get("model"), "config", None)
            if model_config is not None and hasattr(model_config, "to_dict"):
                config["model_config"] = model_config.to_dict()
            config = trimmed_config(config)
        self.run = im.init(
            project=self.project,
            run_id=self._run_id,
            upload_mode=self.upload_mode,
            config=config,
            **self.init_kwargs,
        )
        self._run_id = self.run.run_id  # (an evaluation after training logs to the same run)
        self._reset_step()
        self._last_step_end = time.perf_counter()
        self._pending.clear()

    def _reset_step(self) -> None:
        self._loss = self._weight = self._grad_norm = None
        self._data_time = 0.0 if self._collator is not None else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        started, self._last_step_end = self._last_step_end, now
        data_time = self._data_time
        if self._loss is not None:  # (nothing measured without the trainer)
            step_time = now - started if started is not None else math.nan
            entry = (state.global_step, self._loss, self._grad_norm, data_time, step_time, self._weight)
            self._pending.append(entry)
        self._reset_step()
        if self._to_host or len(self._pending) >= _MAX_PENDING_STEPS:
            self._flush(args)

    def _flush(self, args: Any) -> None:
        """Log the measured steps: their tensors become numbers here, when the device has caught up."""
        run = self.run
        if run is None or not self._pending:
            return
        pending, self._pending = self._pending, []
        for step, loss, grad_norm, data_time, step_time, weight in pending:
            metrics: dict[str, Any] = {LOSS: float(loss), STEP_TIME: step_time}
            if grad_norm is not None:
                metrics[GRAD_NORM] = float(grad_norm)
            if data_time is not None:
                metrics[DATA_TIME] = data_time
            run.log_rank_metrics(
                metrics,
                step=step,
                rank=args.process_index,
                world_size=args.world_size,
                local_rank=args.local_process_index,
                weight=float(weight),
            )

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self._flush(args)
        if not (state.is_world_process_zero and logs and self._run_id is not None):
            return  # (no run to log to before the first training has resolved its id)
        values = _numbers(logs)
        if not values:
            return
        if self.run is not None:
            self.run.log(values, step=state.global_step)
            return
        # After training (trainer.evaluate() once train() returned): into the same run, closed at once.
        with im.init(self.project, self._run_id, self.upload_mode, **self.init_kwargs) as run:
            run.log(values, step=state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush(args)
        if self.run is not None:
            self.run.finish()
            self.run = None
