"""Fine-tuning a BERT-style sequence classifier the way the Hugging Face and peft examples do it.

``BertForSequenceClassification`` built from a small ``BertConfig`` (no download), a
``DataLoader`` of tokenized ``input_ids`` / ``attention_mask`` / ``labels`` batches, ``AdamW``
with weight decay off for biases and LayerNorm weights, a linear warmup-then-decay schedule
(``get_linear_schedule_with_warmup``) and ``clip_grad_norm_``; the model computes its own loss
from ``labels``. With ``lora=True`` the model is wrapped by ``peft.get_peft_model`` with a
``LoraConfig`` (task ``SEQ_CLS``, ``target_modules=["query", "value"]``) first, as the peft
sequence-classification examples do: only the adapters and the new classifier train.

What is fine-tuned is a "pretrained" encoder: the same architecture trained first (once per
process, then cached) on a related task, whose ``bert`` weights are loaded under a freshly
initialised classifier, as ``from_pretrained`` does for a checkpoint without the task's head.
The "sentences" are random token ids after a ``[CLS]`` token; a sentence is positive when one of
three "keyword" tokens occurs in it (about half of them do); the pretraining task had four.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import Result, attach, detach

CLS, KEYWORDS, PRETRAINING_KEYWORDS = 1, (4, 5, 6), (4, 5, 6, 7)
#: pretrained encoders by architecture (built once per process)
_PRETRAINED: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}


@dataclass
class Config:
    vocab_size: int = 64
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    max_seq_length: int = 16
    samples: int = 1024
    batch_size: int = 16
    learning_rate: float = 5e-5
    num_warmup_steps: int = 6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    steps: int = 60
    seed: int = 42
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    # plants
    optimizer_before_peft: bool = False  # the optimizer is built from the base model, then peft wraps it
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class Sentences(torch.utils.data.Dataset):
    """Tokenized sentences: ``[CLS]`` then random tokens; label 1 when a keyword occurs."""

    def __init__(self, cfg: Config, keywords: tuple[int, ...] = KEYWORDS, seed: int | None = None) -> None:
        g = torch.Generator().manual_seed(cfg.seed if seed is None else seed)
        ids = torch.randint(keywords[0], cfg.vocab_size, (cfg.samples, cfg.max_seq_length), generator=g)
        ids[:, 0] = CLS
        self.input_ids = ids
        self.labels = torch.isin(ids, torch.tensor(keywords)).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": torch.ones_like(self.input_ids[i]),
                "labels": self.labels[i]}


def grouped_parameters(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups as in the Hugging Face examples: no weight decay for biases and LayerNorm weights."""
    no_decay = ["bias", "LayerNorm.weight"]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def bert_config(cfg: Config) -> Any:
    import transformers

    return transformers.BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                   num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                                   intermediate_size=cfg.intermediate_size,
                                   max_position_embeddings=cfg.max_seq_length, num_labels=2)


def pretrained(cfg: Config) -> dict[str, torch.Tensor]:
    """The encoder's weights after training on the pretraining task (AdamW 1e-2, 60 steps)."""
    import transformers

    key = (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size,
           cfg.max_seq_length)
    if key not in _PRETRAINED:
        with torch.random.fork_rng():
            transformers.set_seed(0)
            model = transformers.BertForSequenceClassification(bert_config(cfg))
            optimizer = torch.optim.AdamW(grouped_parameters(model, 0.01), lr=1e-2)
            scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 6, 60)
            loader = torch.utils.data.DataLoader(Sentences(cfg, PRETRAINING_KEYWORDS, seed=0), batch_size=16,
                                                 shuffle=True, generator=torch.Generator().manual_seed(0))
            fit(model, optimizer, scheduler, loader, 60, 1.0, lambda **scalars: None)
        _PRETRAINED[key] = {k: v.detach().clone() for k, v in model.bert.state_dict().items()}
    return _PRETRAINED[key]


def fit(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any, steps: int,
        max_grad_norm: float, observe: Any) -> tuple[list[float], float]:
    """The training loop of the examples; the losses, and the accuracy over the last 10 batches."""
    losses: list[float] = []
    correct = seen = 0
    model.train()
    while len(losses) < steps:
        for batch in loader:
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) > steps - 10:
                correct += int((outputs.logits.argmax(-1) == batch["labels"]).sum())
                seen += len(batch["labels"])
            if len(losses) == steps:
                break
    return losses, correct / max(seen, 1)


def train(cfg: Config) -> Result:
    import transformers

    encoder = pretrained(cfg)
    transformers.set_seed(cfg.seed)
    model = transformers.BertForSequenceClassification(bert_config(cfg))
    model.bert.load_state_dict(encoder)  # from_pretrained: the encoder's weights, a new classifier
    optimizer = None
    if cfg.lora:
        from peft import LoraConfig, TaskType, get_peft_model

        if cfg.optimizer_before_peft:  # the bug: built from the base model, before peft adds the adapters
            optimizer = torch.optim.AdamW(grouped_parameters(model, cfg.weight_decay), lr=cfg.learning_rate)
        peft_config = LoraConfig(task_type=TaskType.SEQ_CLS, r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout, target_modules=["query", "value"])
        model = get_peft_model(model, peft_config)
    if optimizer is None:
        optimizer = torch.optim.AdamW(grouped_parameters(model, cfg.weight_decay), lr=cfg.learning_rate)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=cfg.num_warmup_steps,
                                                             num_training_steps=cfg.steps)
    loader = torch.utils.data.DataLoader(Sentences(cfg), batch_size=cfg.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(cfg.seed))
    observe = attach(model, cfg.run, **cfg.watch)
    try:
        losses, accuracy = fit(model, optimizer, scheduler, loader, cfg.steps, cfg.max_grad_norm, observe)
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"model": model, "accuracy": accuracy})
