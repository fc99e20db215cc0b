"""A Hugging Face ``Trainer`` job on the CPU with the InstantML callback: every rank's own values.

    export INSTANTML_API_URL=http://127.0.0.1:8787 INSTANTML_API_KEY=<token>
    torchrun --nproc-per-node 2 examples/hf_trainer.py                                # clean
    SLOW_RANK=1 SLOW_SECONDS=0.05 torchrun --nproc-per-node 4 examples/hf_trainer.py  # a slow collator

A tiny GPT-2 built from a config (random weights: nothing is downloaded) learns a synthetic language:
sequences of 12 to 32 tokens that count up from a random start, padded per batch. The only InstantML
line is ``callbacks=[InstantMLCallback()]``: each rank logs its own loss, grad norm, data and step times
with its token count as the weight; rank 0 logs the trainer's logs and its config (``TrainingArguments``
and the model config). Every rank joins the run named by torchrun's ``--rdzv-id``.

``SLOW_RANK`` (and ``SLOW_SECONDS``, default 0.05) makes that rank's data collator sleep per batch, like a
rank tokenizing on a slow CPU; the others then wait for it. ``STEPS`` (default 40) sets the length,
``LOGGING_STEPS`` (default 1) how often the trainer logs, ``INSTANTML_PROJECT`` the project
(default ``hf-trainer``). Set ``HF_HUB_OFFLINE=1`` to be sure nothing is fetched.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from instantml.integrations.transformers import InstantMLCallback

STEPS = int(os.environ.get("STEPS", "40"))
LOGGING_STEPS = int(os.environ.get("LOGGING_STEPS", "1"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_SECONDS = float(os.environ.get("SLOW_SECONDS", "0.05"))
VOCAB, PAD = 64, 0
BATCH_SIZE = 8


class CountingSequences(torch.utils.data.Dataset[dict[str, list[int]]]):
    """Sequences that count up (mod the vocabulary) from a random start, of random lengths."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(1, VOCAB, (size,), generator=generator).tolist()
        lengths = torch.randint(12, 33, (size,), generator=generator).tolist()
        self.rows = [
            [1 + (s + i) % (VOCAB - 1) for i in range(n)] for s, n in zip(starts, lengths, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[index]}


class PadCollator:
    """Pads a batch; the labels are the inputs with padding left out of the loss (-100)."""

    def __init__(self, slow_seconds: float) -> None:
        self.slow_seconds = slow_seconds

    def __call__(self, samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        if self.slow_seconds:
            time.sleep(self.slow_seconds)  # a slow CPU on this rank only
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), width), PAD)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
            mask[row, : len(sample["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, loss_type="ForCausalLM"
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = PAD, None, None
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=BATCH_SIZE,
            max_steps=STEPS,
            learning_rate=3e-3,
            logging_steps=LOGGING_STEPS,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
            ddp_find_unused_parameters=False,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=CountingSequences(STEPS * BATCH_SIZE * world_size),
            eval_dataset=CountingSequences(4 * BATCH_SIZE * world_size, seed=1),
            data_collator=PadCollator(SLOW_SECONDS if rank == SLOW_RANK else 0.0),
            callbacks=[InstantMLCallback(project=os.environ.get("INSTANTML_PROJECT", "hf-trainer"))],
        )
        trainer.train()
        trainer.evaluate()  # rank 0 logs eval/loss to the same run, after training


if __name__ == "__main__":
    main()
