"""Hugging Face Trainer: one callback watches a tiny GPT-2 (built from a config, nothing downloaded).

Run it with ``python examples/hf_trainer_example.py`` (needs ``pip install -e ".[hf]"``); it
writes ``runs/hf-trainer-example``. The Trainer clips gradients to ``max_grad_norm=1.0`` before
the optimizer step: ``grad_norm`` is the norm the optimizer applied, ``grad_norm_preclip`` the
norm before clipping (what the Trainer logs as ``grad_norm``, and what the exploding detector judges).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradwatch as gw
from gradwatch.integrations.transformers import GradWatchCallback


class Copying(torch.utils.data.Dataset):
    """Sequences that repeat their first half: a pattern the model can learn."""

    def __init__(self, n: int = 512, half: int = 8) -> None:
        first = torch.randint(0, 64, (n, half), generator=torch.Generator().manual_seed(0))
        self.ids = torch.cat([first, first], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments(output_dir="out/hf-trainer-example", max_steps=60, learning_rate=3e-3,
                         per_device_train_batch_size=16, max_grad_norm=1.0, logging_steps=20,
                         report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
callback = GradWatchCallback(run="runs/hf-trainer-example", overwrite=True)  # gw.watch's arguments
Trainer(model=model, args=args, train_dataset=Copying(), callbacks=[callback]).train()

run = gw.open_run("runs/hf-trainer-example")
print(f"{run.steps} steps, status {run.status}, findings: {len(run.findings())}")
print(run.scalars()[["loss", "grad_norm_preclip", "grad_norm"]].iloc[::10].round(3))
