"""A small ResNet trained the way the widely copied CIFAR training scripts do it.

``BasicBlock``s (conv-BN-``F.relu``-conv-BN plus a shortcut, 1x1 conv + BN when the shape
changes) in three stages, global average pooling and a linear classifier; SGD with momentum 0.9
and weight decay 5e-4, cosine annealing of the learning rate, cross-entropy. The images are
16x16 noisy copies of 10 fixed random class templates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Result, attach, detach


@dataclass
class Config:
    width: int = 8
    num_blocks: tuple[int, int, int] = (1, 1, 1)
    num_classes: int = 10
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    steps: int = 60
    seed: int = 0
    # plants
    lr_scale: float = 1.0
    dead_block: str | None = None  # this block's bn1 bias starts at -10: F.relu zeroes its whole output
    dropped_branch: str | None = None  # this block's forward returns the shortcut only (forgets "+=")
    frozen_bn: bool = False  # the "no weight decay" group of BatchNorm parameters gets lr 0 by mistake
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(self.expansion * planes),
            )
        self.dropped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.dropped:
            out = self.shortcut(x)  # the bug: meant out += self.shortcut(x)
        else:
            out += self.shortcut(x)
        return F.relu(out)


class ResNet(nn.Module):
    def __init__(self, num_blocks: tuple[int, int, int], width: int, num_classes: int) -> None:
        super().__init__()
        self.in_planes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = self._make_layer(width, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(2 * width, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(4 * width, num_blocks[2], stride=2)
        self.linear = nn.Linear(4 * width, num_classes)

    def _make_layer(self, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes * BasicBlock.expansion
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def batches(cfg: Config, step: int, templates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50_000 + step)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g)
    return 0.5 * templates[y] + torch.randn(cfg.batch_size, 3, 16, 16, generator=g), y


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(cfg.num_classes, 3, 16, 16, generator=torch.Generator().manual_seed(cfg.seed + 1))
    net = ResNet(cfg.num_blocks, cfg.width, cfg.num_classes)
    if cfg.dead_block is not None:
        with torch.no_grad():
            net.get_submodule(cfg.dead_block).bn1.bias.fill_(-10.0)
    if cfg.dropped_branch is not None:
        block = net.get_submodule(cfg.dropped_branch)
        assert isinstance(block, BasicBlock)
        block.dropped = True
    criterion = nn.CrossEntropyLoss()
    lr = cfg.lr * cfg.lr_scale
    bn = [p for m in net.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]
    rest = [p for p in net.parameters() if all(p is not q for q in bn)]
    bn_group: dict[str, Any] = {"params": bn, "weight_decay": 0.0}
    if cfg.frozen_bn:
        bn_group["lr"] = 0.0  # the bug: meant weight_decay=0, not lr=0
    optimizer = torch.optim.SGD([{"params": rest}, bn_group], lr=lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    observe = attach(net, cfg.run, **cfg.watch)
    losses = []
    try:
        net.train()
        for step in range(cfg.steps):
            inputs, targets = batches(cfg, step, templates)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        detach(net, cfg.run)
    return Result(losses, cfg.run, {"model": net})
