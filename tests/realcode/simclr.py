"""Contrastive pre-training in the style of the widely copied SimCLR training scripts.

Each batch is augmented twice (random shift crop, horizontal flip, brightness / contrast jitter,
then per-image standardisation); a small convolutional encoder with BatchNorm and a
projection head (Linear -> BatchNorm1d -> ReLU -> Linear) embed both views; the NT-Xent loss with
a temperature is a cross-entropy over the 2N x 2N cosine similarities with each sample's own
entry masked out and its other view as the target. SGD with momentum and weight decay, a cosine
schedule stepped per iteration. The images are 16x16 noisy copies of 10 fixed random class
templates (the labels are never used).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Result, compiled_and_watched, detach_watched


@dataclass
class Config:
    width: int = 16
    feature_dim: int = 32
    projection_dim: int = 16
    batch_size: int = 32
    temperature: float = 0.2
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    steps: int = 200
    seed: int = 0
    # plants
    lr_scale: float = 1.0
    head_left_out: bool = False  # the optimizer is built from the encoder's parameters only
    blank_image_at: int | None = None  # this step's batch holds a blank (constant) image: standardising it is 0/0
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None  # "compile-watched": torch.compile(gw.watch(model)); "watch-compiled": the other order


def conv_bn(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SimCLR(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        w = cfg.width
        self.encoder = nn.Sequential(conv_bn(3, w, 1), conv_bn(w, 2 * w, 2), conv_bn(2 * w, cfg.feature_dim, 2),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector = nn.Sequential(nn.Linear(cfg.feature_dim, cfg.feature_dim, bias=False),
                                       nn.BatchNorm1d(cfg.feature_dim), nn.ReLU(inplace=True),
                                       nn.Linear(cfg.feature_dim, cfg.projection_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One random view of each image."""
    n = x.shape[0]
    out = torch.empty_like(x)
    shifts = torch.randint(-2, 3, (n, 2), generator=g).tolist()
    flips = torch.rand(n, generator=g) < 0.5
    for i in range(n):  # random crop with padding, as a shift; horizontal flip
        img = torch.roll(x[i], shifts=tuple(shifts[i]), dims=(1, 2))
        out[i] = img.flip(2) if flips[i] else img
    contrast = 1 + 0.4 * (torch.rand(n, 1, 1, 1, generator=g) - 0.5)
    brightness = 0.4 * (torch.rand(n, 1, 1, 1, generator=g) - 0.5)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    out = (out - mean) * contrast + mean + brightness
    # per-image standardisation (no epsilon: a constant image is 0/0)
    return (out - out.mean(dim=(1, 2, 3), keepdim=True)) / out.std(dim=(1, 2, 3), keepdim=True)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    n = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.t() / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))  # never its own entry
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])  # each view's positive: the other view
    return F.cross_entropy(sim, targets)


def images(cfg: Config, step: int, templates: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(90_000 + step)
    y = torch.randint(0, len(templates), (cfg.batch_size,), generator=g)
    x = 0.5 * templates[y] + torch.randn(cfg.batch_size, 3, 16, 16, generator=g)
    if step == cfg.blank_image_at:
        x[5] = 0.0  # an all-black image in the data set
    return x


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(10, 3, 16, 16, generator=torch.Generator().manual_seed(cfg.seed + 1))
    model = SimCLR(cfg)
    trained = model.encoder.parameters() if cfg.head_left_out else model.parameters()
    optimizer = torch.optim.SGD(trained, lr=cfg.lr * cfg.lr_scale, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    net, observe = compiled_and_watched(model, cfg)
    losses = []
    try:
        model.train()
        for step in range(cfg.steps):
            x = images(cfg, step, templates)
            g = torch.Generator().manual_seed(cfg.seed * 100_000 + step)
            x1, x2 = augment(x, g), augment(x, g)
            loss = nt_xent(net(x1), net(x2), cfg.temperature)
            optimizer.zero_grad()
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    bn = model.get_submodule("encoder.0.1")
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
    return Result(losses, cfg.run, {"model": model, "running_mean": bn.running_mean.clone()})
