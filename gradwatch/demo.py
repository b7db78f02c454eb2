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


class Polar(nn.Module):
    """Polar features of a 2-D point: (x / |x|, |x|). Divides by zero at the origin."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Unit direction and radius."""
        radius = x.norm(dim=1, keepdim=True)
        return torch.cat([x / radius, radius], dim=1)


class SpiralNet(nn.Module):
    """A small MLP classifier: polar features -> hidden x depth (Tanh) -> classes."""

    def __init__(self, hidden: int = 64, depth: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.features = Polar()
        blocks: list[nn.Module] = []
        width = 3
        for _ in range(depth):
            blocks += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of 2-D points."""
        return self.head(self.body(self.features(x)))


#: the demo's planted trouble: (step, what happens to that step's batch)
POISONED_STEP = 100  # a point exactly at the origin: 0 / 0 in the polar features
CORRUPTED_STEP = 180  # a batch of unnormalised points (x1000): the gradient norm explodes


def run_demo(run: str | Path = "runs/demo", *, steps: int = 300, batch: int = 64, seed: int = 0,
             console: bool = True) -> Path:
    """Train the demo model with gradwatch attached and its default rules; returns the run directory.

    Two batches are bad on purpose: at step 100 one point sits exactly at the origin (its polar
    features divide 0 by 0, a NaN is born in ``features``; the default rules skip that step), and
    at step 180 the points are 1000x too large (the gradient explodes; the default rules clip it
    to the norm the run's own history calls normal). Training converges regardless.
    """
    torch.manual_seed(seed)
    x, y = spirals(1536, seed=seed)
    model = gw.watch(SpiralNet(), run=run, overwrite=True, console=console)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    gen = torch.Generator().manual_seed(seed)
    with gw.watcher(model) as watcher:
        for step in range(steps):
            idx = torch.randint(0, len(x), (batch,), generator=gen)
            xb = x[idx].clone()
            if step == POISONED_STEP:
                xb[0] = 0.0
            elif step == CORRUPTED_STEP:
                xb = xb * 1000.0
            loss = nn.functional.cross_entropy(model(xb), y[idx])
            optimizer.zero_grad()
            loss.backward()
            watcher.observe(loss=loss)
            optimizer.step()
            scheduler.step()
    return watcher.run_dir
