"""A small CNN classifier trained the way the PyTorch MNIST example and its many copies do,
with the usual additions: BatchNorm after each convolution, ``AdamW``, a ``OneCycleLR`` schedule
stepped every batch and ``clip_grad_norm_``.

``conv1 -> bn1 -> relu -> conv2 -> bn2 -> relu -> max_pool2d -> dropout -> flatten -> fc1 ->
relu -> dropout -> fc2 -> log_softmax`` with ``F.nll_loss``; the test accuracy is measured after
training. The images are 12x12 noisy copies of 10 fixed random class templates.
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
    batch_size: int = 32
    test_samples: int = 512
    lr: float = 1e-2
    weight_decay: float = 0.01
    max_norm: float = 1.0
    steps: int = 60
    seed: int = 1
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.bn2 = nn.BatchNorm2d(16)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def images(n: int, templates: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 10, (n,), generator=g)
    return templates[y] + 0.8 * torch.randn(n, 1, 12, 12, generator=g), y


def test(model: Net, data: torch.Tensor, target: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = int((model(data).argmax(dim=1) == target).sum())
    return correct / len(target)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(10, 1, 12, 12, generator=torch.Generator().manual_seed(cfg.seed + 1))
    test_data, test_target = images(cfg.test_samples, templates, torch.Generator().manual_seed(cfg.seed + 2))
    g = torch.Generator().manual_seed(cfg.seed + 3)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=cfg.steps)
    observe = attach(model, cfg.run, **cfg.watch)
    losses = []
    try:
        model.train()
        for _ in range(cfg.steps):
            data, target = images(cfg.batch_size, templates, g)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        accuracy = test(model, test_data, test_target)
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"model": model, "accuracy": accuracy})
