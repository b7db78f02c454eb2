"""LoRA fine-tuning the way the widely copied PEFT-style scripts do it.

A small pretrained-looking transformer encoder classifier (its weights random, then frozen with
``requires_grad_(False)``) whose attention projections ``q_proj`` and ``v_proj`` are wrapped in a
LoRA layer shaped like PEFT's: the frozen ``base_layer`` plus ``lora_A`` and ``lora_B`` as
``ModuleDict``s of one adapter (``"default"``), ``lora_A`` kaiming-uniform initialised, ``lora_B``
zero-initialised, the update scaled by ``alpha / r``; only the LoRA parameters (and the new
classifier head, ``modules_to_save``-style) train. ``AdamW`` at 2e-4 with weight decay 0.01 under a
per-iteration linear warmup from 0 then linear decay (``get_linear_schedule_with_warmup``'s shape),
``clip_grad_norm_`` at 1.0. The task: classify sequences of tokens by which of 4 fixed random
patterns their tokens were drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Result, compiled_and_watched, detach_watched


@dataclass
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    depth: int = 2
    seq_len: int = 12
    num_labels: int = 4
    r: int = 4
    alpha: int = 8
    lora_dropout: float = 0.05
    train_head: bool = True
    batch_size: int = 32
    steps: int = 200
    lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the peak learning rate actually used is lr * lr_scale
    b_left_out: bool = False  # the optimizer is given only the lora_A parameters (a name filter "lora_A" for "lora_")
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: int, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout)})
        lora_a, lora_b = nn.Linear(base.in_features, r, bias=False), nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(lora_b.weight)
        self.lora_A = nn.ModuleDict({"default": lora_a})
        self.lora_B = nn.ModuleDict({"default": lora_b})
        self.scaling = {"default": alpha / r}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        a, b = self.lora_A["default"], self.lora_B["default"]
        return out + b(a(self.lora_dropout["default"](x))) * self.scaling["default"]


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj: nn.Module = nn.Linear(dim, dim)  # q_proj and v_proj: LoRA layers once wrapped
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj: nn.Module = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = SelfAttention(dim, heads)
        self.attention_norm = nn.LayerNorm(dim)
        self.intermediate = nn.Linear(dim, 4 * dim)
        self.output = nn.Linear(4 * dim, dim)
        self.output_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class Classifier(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.position_embeddings = nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleList([Layer(cfg.dim, cfg.heads) for _ in range(cfg.depth)])
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids) + self.position_embeddings(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x.mean(1))


def get_peft_model(model: Classifier, cfg: Config) -> Classifier:
    """Freeze everything, wrap q_proj and v_proj in LoRA layers; the head trains (modules_to_save)."""
    model.requires_grad_(False)
    for layer in model.layers:
        att = layer.attention
        assert isinstance(att, SelfAttention)
        assert isinstance(att.q_proj, nn.Linear) and isinstance(att.v_proj, nn.Linear)
        att.q_proj = LoraLinear(att.q_proj, cfg.r, cfg.alpha, cfg.lora_dropout)
        att.v_proj = LoraLinear(att.v_proj, cfg.r, cfg.alpha, cfg.lora_dropout)
    model.classifier.requires_grad_(cfg.train_head)
    return model


def linear_warmup(cfg: Config) -> Any:
    def factor(it: int) -> float:
        if it < cfg.warmup_steps:
            return it / max(1, cfg.warmup_steps)
        return max(0.0, (cfg.steps - it) / max(1, cfg.steps - cfg.warmup_steps))
    return factor


def batch(cfg: Config, step: int, patterns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(80_000 + step)
    y = torch.randint(0, cfg.num_labels, (cfg.batch_size,), generator=g)
    ids = torch.multinomial(patterns[y], cfg.seq_len, replacement=True, generator=g)
    return ids, y


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    seeded = torch.Generator().manual_seed(cfg.seed + 1)
    patterns = torch.softmax(3 * torch.randn(cfg.num_labels, cfg.vocab, generator=seeded), -1)
    model = get_peft_model(Classifier(cfg), cfg)  # "pretrained": random weights, frozen
    net, observe = compiled_and_watched(model, cfg)
    wanted = "lora_A" if cfg.b_left_out else "lora_"  # the plant: a name filter one letter too long
    params = [p for n, p in model.named_parameters() if p.requires_grad and (wanted in n or n.startswith("classifier"))]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr * cfg.lr_scale, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(cfg))
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            model.train()
            ids, y = batch(cfg, step, patterns)
            loss = F.cross_entropy(net(ids), y)
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model})
