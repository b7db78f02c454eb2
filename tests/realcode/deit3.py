"""A vision transformer trained the way the widely copied timm / DeiT III scripts do it.

Patch embedding by a strided conv, a ``cls_token`` on the model initialised with std 1e-6 and a
learned ``pos_embed`` (trunc-normal, std 0.02), pre-norm blocks whose attention and MLP branches
each pass a timm-style ``LayerScale`` leaf (``gamma`` initialised at ``init_values``, 1e-5 here)
and stochastic depth; the cls token's final LayerNorm feeds a linear head. Cross-entropy with label
smoothing; ``AdamW`` with a no-weight-decay group (norms, biases, ``cls_token``, ``pos_embed``,
layer scales), a per-iteration linear warmup from 0 then cosine, ``clip_grad_norm_``. The images
are 16x16 noisy copies of 10 fixed random class templates.
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
    dim: int = 32
    depth: int = 2
    heads: int = 4
    patch: int = 4
    num_classes: int = 10
    init_values: float = 1e-5
    drop_path_rate: float = 0.05
    batch_size: int = 32
    steps: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 20
    weight_decay: float = 0.05
    smoothing: float = 0.1
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the peak learning rate actually used is lr * lr_scale
    log_softmax_by_hand_at: int | None = None  # from this step the loss is log(softmax(x)) written by hand: log(0)
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1 - self.p
        return x * x.new_empty((x.shape[0], 1, 1)).bernoulli_(keep) / keep


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, init_values: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim, init_values)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ls2 = LayerScale(dim, init_values)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, cfg.dim, cfg.patch, stride=cfg.patch)
        tokens = (16 // cfg.patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, cfg.dim))
        rates = torch.linspace(0, cfg.drop_path_rate, cfg.depth).tolist()
        self.blocks = nn.Sequential(*[Block(cfg.dim, cfg.heads, cfg.init_values, rates[i]) for i in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name in ("cls_token", "pos_embed") or name.endswith(".gamma") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(cfg: Config) -> Any:
    floor = cfg.min_lr / cfg.lr

    def factor(it: int) -> float:
        if it < cfg.warmup_steps:
            return it / cfg.warmup_steps
        progress = (it - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def images(cfg: Config, step: int, templates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(60_000 + step)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g)
    return 0.5 * templates[y] + torch.randn(cfg.batch_size, 3, 16, 16, generator=g), y


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(cfg.num_classes, 3, 16, 16, generator=torch.Generator().manual_seed(cfg.seed + 1))
    model = VisionTransformer(cfg)
    net, observe = compiled_and_watched(model, cfg)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr * cfg.lr_scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            model.train()
            x, y = images(cfg, step, templates)
            logits = net(x)
            if cfg.log_softmax_by_hand_at is not None and step >= cfg.log_softmax_by_hand_at:
                # the plant: log(softmax(x / 1e-3)) by hand (a temperature of 1e-3): a probability 0, 0 * log(0) = NaN
                loss = -(F.one_hot(y, cfg.num_classes) * torch.log(torch.softmax(logits / 1e-3, -1))).sum(-1).mean()
            else:
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model})
