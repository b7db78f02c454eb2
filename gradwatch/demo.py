"""Demo: a small built-in model trained on synthetic data, watched by gradwatch end to end."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import gradwatch as gw


def spirals(n: int, classes: int = 3, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved noisy spirals in 2-D, a classic small classification problem."""
    gen = torch.Generator().manual_seed(seed)
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, per)
        theta = torch.linspace(c * 2 * math.pi / classes, c * 2 * math.pi / classes + 2 * math.pi, per)
        theta = theta + 0.1 * torch.randn(per, generator=gen)
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((per,), c, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


class SpiralNet(nn.Module):
    """A small MLP classifier: 2 -> hidden x depth (Tanh) -> classes."""

    def __init__(self, hidden: int = 64, depth: int = 5, classes: int = 3) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = 2
        for _ in range(depth):
            blocks += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of 2-D points."""
        return self.head(self.body(x))


def run_demo(run: str | Path = "runs/demo", *, steps: int = 300, batch: int = 64, seed: int = 0) -> Path:
    """Train the demo model with gradwatch attached; returns the run directory."""
    torch.manual_seed(seed)
    x, y = spirals(1536, seed=seed)
    model = gw.watch(SpiralNet(), run=run, overwrite=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    gen = torch.Generator().manual_seed(seed)
    with gw.watcher(model) as watcher:
        for _ in range(steps):
            idx = torch.randint(0, len(x), (batch,), generator=gen)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            watcher.observe(loss=loss)
            optimizer.step()
            scheduler.step()
    return watcher.run_dir
