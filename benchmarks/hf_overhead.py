"""What the Hugging Face Trainer callback costs a training step, beside the same Trainer loop without it and
beside wandb's own integration, measured in one run.

    make bench   # or: PYTHONPATH=. .cache/venv-bench-hf/bin/python benchmarks/hf_overhead.py [--rounds N]

``.cache/venv-bench-hf`` is made by ``make bench`` from ``infra/lock/bench-hf.txt`` (torch, transformers and
accelerate as the tests pin them, and wandb; without wandb its column is skipped). Any Python with torch,
transformers and accelerate runs it.

One process, one thread for torch, a tiny GPT-2 built from a config (random weights) whose forward also
sleeps ``--forward-sleep`` (50 ms): a step of 50 ms or more whose length CPU contention from other
processes moves less, so a small overhead can show. Four trainers share the model and the data and differ
only in what observes them: none (``report_to="none"``), none again (the same: its difference from the
first is the noise floor of the comparison), ``callbacks=[InstantMLCallback(upload_mode="offline")]`` (the
training process's whole path: every step's per-rank event and every log of rank 0 appended to its spool
file; spool mode adds only an uploader in another process), and ``report_to="wandb"`` with
``WANDB_MODE=offline``. They take turns (in a rotating order), ``--rounds`` times ``--steps`` optimizer
steps each, so drift of the machine falls on all alike. A step's time is the interval between two
``on_step_end`` calls of a timing callback (the whole cycle: data, forward, backward, optimizer, every
callback, the trainer's logging); the first 3 steps of each turn are left out. Overhead: the median step
time against the baseline's, and the median over rounds of each round's ratio of medians (paired). On a
shared machine both move by a few percent (see "none, again"), so each observer's own time is also
measured directly: its per-step hooks timed in place, plus, for the callback, what its wrappers add per
micro-batch inside the trainer's methods.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per turn")
    parser.add_argument("--forward-sleep", type=float, default=0.05, help="seconds slept in each forward")
    parser.add_argument("--logging-steps", type=int, default=10, help="the trainer's logging_steps")
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="hf-overhead-"))
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_DIR=str(workdir),
        WANDB_SILENT="true",
        HF_HUB_OFFLINE="1",
        INSTANTML_PROJECT="hf-overhead",
        INSTANTML_RUN_ID="hf-overhead",
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)

    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from instantml.integrations.transformers import InstantMLCallback

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()

    class StepTimes(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last: float | None = None

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.last = None

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    hook_time: dict[str, float] = {}
    step_hooks = ("on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step")
    step_hooks += ("on_step_end", "on_log", "on_save")

    def time_hooks(callback: Any, variant: str) -> None:
        """Time the callback's per-step hooks in place (its own time, beside the noisy medians)."""
        hook_time[variant] = 0.0

        def timed(hook: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return hook(*args, **kwargs)
                finally:
                    hook_time[variant] += time.perf_counter() - started

            return call

        for name in step_hooks:
            setattr(callback, name, timed(getattr(callback, name)))

    seq, batch, vocab = 64, 8, 512
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    # The rest of a 50 ms step: a sleep, which other processes on a shared machine cannot slow down.
    model.register_forward_pre_hook(lambda module, inputs: time.sleep(options.forward_sleep))
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (options.steps * batch * 2, seq), generator=generator)
    data = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in rows]

    # "none, again" is the same as "none": its difference is the noise floor of the other columns.
    variants = ["none", "none, again", "instantml"]
    if importlib.util.find_spec("wandb") is not None:
        variants.append("wandb offline")
    else:
        print("wandb is not installed in this Python: its column is skipped", file=sys.stderr)

    trainers: dict[str, tuple[Trainer, StepTimes]] = {}
    for variant in variants:
        timer = StepTimes()
        callbacks: list[Any] = [timer]
        if variant == "instantml":
            callbacks.insert(0, InstantMLCallback(upload_mode="offline", spool_dir=str(workdir / "spool")))
        args = TrainingArguments(
            output_dir=str(workdir / variant.replace(" ", "-")),
            per_device_train_batch_size=batch,
            max_steps=options.steps,
            logging_steps=options.logging_steps,
            save_strategy="no",
            report_to="wandb" if variant.startswith("wandb") else "none",
            run_name="hf-overhead",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        for callback in trainer.callback_handler.callbacks:
            if type(callback).__name__ in ("InstantMLCallback", "WandbCallback"):
                time_hooks(callback, variant)
        trainers[variant] = trainer, timer

    per_round: dict[str, list[float]] = {v: [] for v in variants}
    everything: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(options.rounds):
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            trainer, timer = trainers[variant]
            timer.times.clear()
            with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints its logs
                trainer.train()
            steps = timer.times[WARMUP_STEPS:]
            per_round[variant].append(statistics.median(steps))
            everything[variant].extend(steps)

    hook_steps = options.rounds * options.steps
    # What the callback's wrappers add per micro-batch inside the trainer's methods: a token count and an
    # on-device sum (the clock reads and a deque pop are far below these).
    from instantml.integrations.transformers import _batch_weight

    sample = {k: torch.stack([d[k] for d in data[:batch]]) for k in data[0]}
    loss = torch.tensor(2.0)
    started = time.perf_counter()
    for _ in range(1000):
        _batch_weight(sample)
        loss = loss + loss * 0
    wrapped = (time.perf_counter() - started) / 1000

    base = statistics.median(everything["none"])
    print(
        f"Trainer step overhead (GPT-2 {config.n_layer}x{config.n_embd}, batch {batch}x{seq} tokens, CPU, "
        f"1 thread, {options.forward_sleep * 1e3:.0f} ms slept in each forward; {options.rounds} rounds x "
        f"{options.steps} steps, logging_steps={options.logging_steps})"
    )
    print(
        f"{'observer':<16}{'median step':>14}{'p90 step':>12}{'overhead':>12}{'paired':>10}{'own hooks':>14}"
    )
    for variant in variants:
        times = everything[variant]
        median = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        ratios = [v / b for v, b in zip(per_round[variant], per_round["none"], strict=True)]
        paired = statistics.median(ratios) - 1
        hooks = f"{hook_time[variant] / hook_steps * 1e3:>10.3f} ms" if variant in hook_time else ""
        print(
            f"{variant:<16}{median * 1e3:>11.2f} ms{p90 * 1e3:>9.2f} ms"
            f"{(median / base - 1) * 100:>+11.2f}%{paired * 100:>+9.2f}%{hooks}"
        )
    own = hook_time["instantml"] / hook_steps + wrapped
    print(
        f"instantml's own time per step: {own * 1e6:.0f} us = {own / base * 100:.3f}% of the median step "
        f"(its hooks {hook_time['instantml'] / hook_steps * 1e6:.0f} us, its wrappers' token count and loss "
        f"sum {wrapped * 1e6:.0f} us)"
    )
    print("goal: the instantml callback within 1% of the step time (steps of 50 ms or more)")


if __name__ == "__main__":
    main()
