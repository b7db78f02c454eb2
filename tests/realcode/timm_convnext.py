"""An image classifier trained the way the widely copied timm-style training scripts do it.

A small ConvNeXt (patchify stem, blocks of depthwise 7x7 conv -> LayerNorm -> pointwise MLP with
GELU -> layer scale initialised at 1e-6 -> stochastic depth, LayerNorm + strided conv
downsampling, global average pooling, a LayerNorm'ed linear head) in ``channels_last`` memory
format; mixup of each batch with its reverse and label-smoothed soft targets with the soft-target
cross-entropy; ``AdamW`` with a no-weight-decay group for norms, biases and layer scales; a
per-iteration linear warmup then cosine schedule (``LambdaLR``); ``clip_grad_norm_``; an EMA copy
of the model (``torch.optim.swa_utils.AveragedModel``, with its buffers) updated after every step,
and the model and its EMA evaluated under ``torch.no_grad`` every ``eval_every`` steps. The
images are 16x16 noisy copies of 10 fixed random class templates.
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
    dims: tuple[int, int] = (16, 32)
    depths: tuple[int, int] = (1, 1)
    num_classes: int = 10
    drop_path_rate: float = 0.1
    layer_scale_init: float = 1e-6
    batch_size: int = 32
    steps: int = 200
    lr: float = 4e-3
    min_lr: float = 1e-5
    warmup_steps: int = 20
    weight_decay: float = 0.05
    clip_grad: float = 1.0
    smoothing: float = 0.1
    mixup_alpha: float = 0.8
    ema_decay: float = 0.99
    eval_every: int = 50
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the peak learning rate actually used is lr * lr_scale
    no_decay_dropped: bool = False  # the no-weight-decay group is built but never given to the optimizer
    zero_grad_removed: bool = False  # the loop's optimizer.zero_grad() was lost in a refactor
    kl_loss: bool = False  # the soft-target loss written as a KL divergence with target.log(): log(0) on a zero target
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None  # "compile-watched": torch.compile(gw.watch(model)); "watch-compiled": the other order


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permuted to the last dimension and back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class DropPath(nn.Module):
    """Stochastic depth: drops a sample's whole residual branch with probability ``drop_prob``."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    def __init__(self, dim: int, drop_path: float, ls_init: float) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(ls_init * torch.ones(dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)  # NCHW -> NHWC for the norm and the MLP
        x = self.mlp(self.norm(x)) * self.gamma
        return shortcut + self.drop_path(x.permute(0, 3, 1, 2))


class ConvNeXt(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, cfg.dims[0], kernel_size=2, stride=2),
                                  LayerNorm2d(cfg.dims[0], eps=1e-6))
        rates = torch.linspace(0, cfg.drop_path_rate, sum(cfg.depths)).tolist()
        stages: list[nn.Module] = []
        for i, (dim, depth) in enumerate(zip(cfg.dims, cfg.depths, strict=True)):
            layers: list[nn.Module] = []
            if i > 0:
                layers += [LayerNorm2d(cfg.dims[i - 1], eps=1e-6), nn.Conv2d(cfg.dims[i - 1], dim, 2, stride=2)]
            start = sum(cfg.depths[:i])
            layers += [Block(dim, rates[start + j], cfg.layer_scale_init) for j in range(depth)]
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.head_norm = nn.LayerNorm(cfg.dims[-1], eps=1e-6)
        self.head = nn.Linear(cfg.dims[-1], cfg.num_classes)
        self.apply(self._init_weights)
        with torch.no_grad():  # timm's head_init_scale
            self.head.weight.mul_(0.1)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.head_norm(x.mean((2, 3))))


def param_groups_weight_decay(model: nn.Module, weight_decay: float, dropped: bool) -> list[dict[str, Any]]:
    """Norms, biases and layer scales without weight decay, the rest with it."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if not dropped:  # the plant: the second group was meant to be appended too
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def warmup_cosine(cfg: Config) -> Any:
    """The multiplier of the peak learning rate at an iteration."""
    floor = cfg.min_lr / cfg.lr

    def factor(it: int) -> float:
        if it < cfg.warmup_steps:
            return (it + 1) / cfg.warmup_steps
        progress = (it - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def mixup(cfg: Config, x: torch.Tensor, y: torch.Tensor, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix the batch with its reverse; label-smoothed one-hot targets mixed the same way."""
    lam = float(torch.distributions.Beta(cfg.mixup_alpha, cfg.mixup_alpha).sample())
    off = smoothing / cfg.num_classes
    one_hot = torch.full((len(y), cfg.num_classes), off).scatter_(1, y[:, None], 1.0 - smoothing + off)
    return lam * x + (1 - lam) * x.flip(0), lam * one_hot + (1 - lam) * one_hot.flip(0)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


class SoftTargetKL(nn.Module):
    """The same gradient as the cross-entropy, written as KL(target || prediction) by hand."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.sum(target * (target.log() - F.log_softmax(x, dim=-1)), dim=-1).mean()


def images(cfg: Config, step: int, templates: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70_000 + step)
    y = torch.randint(0, cfg.num_classes, (n,), generator=g)
    return 0.5 * templates[y] + torch.randn(n, 3, 16, 16, generator=g), y


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(cfg.num_classes, 3, 16, 16, generator=torch.Generator().manual_seed(cfg.seed + 1))
    model = ConvNeXt(cfg).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    net, observe = compiled_and_watched(model, cfg)
    model_ema = torch.optim.swa_utils.AveragedModel(  # a deep copy of the watched model: not watched
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)
    groups = param_groups_weight_decay(model, cfg.weight_decay, cfg.no_decay_dropped)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr * cfg.lr_scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    criterion: nn.Module = SoftTargetKL() if cfg.kl_loss else SoftTargetCrossEntropy()
    smoothing = 0.0 if cfg.kl_loss else cfg.smoothing  # the plant: a KL loss, then label smoothing turned off
    val_x, val_y = images(cfg, -1, templates, 256)
    val_x = val_x.contiguous(memory_format=torch.channels_last)
    losses: list[float] = []
    accuracy: list[float] = []
    ema_accuracy: list[float] = []
    try:
        for step in range(cfg.steps):
            model.train()
            x, y = images(cfg, step, templates, cfg.batch_size)
            x, target = mixup(cfg, x, y, smoothing)
            x = x.contiguous(memory_format=torch.channels_last)
            output = net(x)
            loss = criterion(output, target)
            if not cfg.zero_grad_removed:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            optimizer.step()
            model_ema.update_parameters(model)
            scheduler.step()
            losses.append(loss.item())
            if (step + 1) % cfg.eval_every == 0:
                model.eval()
                with torch.no_grad():
                    accuracy.append(float((net(val_x).argmax(1) == val_y).float().mean()))
                    ema_accuracy.append(float((model_ema(val_x).argmax(1) == val_y).float().mean()))
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model, "ema": model_ema, "accuracy": accuracy,
                                    "ema_accuracy": ema_accuracy})
