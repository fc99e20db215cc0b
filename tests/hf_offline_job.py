"""A single-process Trainer job for tests/stack/test_hf_trainer.py, run in the torch venv: the callback in
offline mode with gradient accumulation, held to log only when the trainer logs (as on an accelerator,
where the loss stays on the device until the trainer synchronises). Prints JSON: the rank events in the
spool after each step, every rank event, and the trainer's logged losses.

    python tests/hf_offline_job.py SPOOL_DIR
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import hf_trainer as example
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from instantml.integrations.transformers import InstantMLCallback

SPOOL = sys.argv[1]


def spool_lines() -> list[dict[str, Any]]:
    files = glob.glob(os.path.join(SPOOL, "*.jsonl"))
    return [json.loads(line) for name in files for line in Path(name).read_text().splitlines()]


def rank_events() -> list[dict[str, Any]]:
    return [line["body"] for line in spool_lines() if line["path"].endswith("/rank-metrics")]


def configs() -> list[dict[str, Any]]:
    """The configs of the run updates in the spool."""
    return [line["body"]["config"] for line in spool_lines() if "config" in line.get("body", {})]


class Deferred(InstantMLCallback):
    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        super().on_train_begin(*args, **kwargs)
        self._to_host = False  # as on an accelerator: numbers only when the trainer logs


class Probe(TrainerCallback):  # type: ignore[misc]
    """How many rank events the spool holds at the end of each step (after the callback's hooks)."""

    seen: ClassVar[dict[int, int]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen[state.global_step] = len(rank_events())


def main() -> None:
    config = GPT2Config(
        vocab_size=example.VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, loss_type="ForCausalLM"
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = example.PAD, None, None
    torch.manual_seed(0)
    callback = Deferred(
        project="hf-offline",
        run_id="offline-1",
        upload_mode="offline",
        spool_dir=SPOOL,
        config={"team": "vision"},  # the user's own, beside the trainer's
    )
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=10,
            logging_steps=5,
            learning_rate=3e-3,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=example.CountingSequences(80),
            data_collator=example.PadCollator(0.0),
            callbacks=[callback, Probe()],
        )
        trainer.train()
    logged = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"seen": Probe.seen, "events": rank_events(), "logged": logged, "configs": configs()}))


if __name__ == "__main__":
    main()
