"""A Hugging Face ``Trainer`` run on a tiny GPT-2 built from a config (no download), as the
widely copied causal-LM fine-tuning scripts do: a tokenized dataset of fixed-length blocks,
``labels = input_ids``, ``TrainingArguments`` with warmup, weight decay and ``max_grad_norm``,
and ``trainer.train()``. gradwatch attaches through its ``GradWatchCallback``.

The "text" is a fixed random Markov chain over a 64-token vocabulary (4 successors per token).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import Result

VOCAB = 64


@dataclass
class Config:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32
    samples: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    per_device_train_batch_size: int = 8
    max_steps: int = 40
    seed: int = 42
    # plants
    lr_scale: float = 1.0
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class Blocks(torch.utils.data.Dataset):
    """Fixed-length blocks of token ids from the chain; labels are the inputs (the model shifts them)."""

    def __init__(self, cfg: Config) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
        ids = torch.empty(cfg.samples, cfg.block_size, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (cfg.samples,), generator=g)
        picks = torch.randint(0, 4, (cfg.samples, cfg.block_size), generator=g)
        for t in range(1, cfg.block_size):
            ids[:, t] = successors[ids[:, t - 1], picks[:, t]]
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(cfg: Config) -> Result:
    import transformers

    transformers.set_seed(cfg.seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    callbacks = []
    if cfg.run is not None:
        from gradwatch.integrations.transformers import GradWatchCallback

        callbacks.append(GradWatchCallback(run=cfg.run, **{"console": False, **cfg.watch}))
    with tempfile.TemporaryDirectory() as out:
        return _train(cfg, model, callbacks, out)


def _train(cfg: Config, model: Any, callbacks: list[Any], out: str) -> Result:
    import transformers

    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        learning_rate=cfg.learning_rate * cfg.lr_scale,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        max_steps=cfg.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Blocks(cfg), callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # no log lines on stdout
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return Result(losses, cfg.run, {"model": model, "trainer": trainer})
