"""The model and the training loop of a small project, as its smoke test runs them.

``train(steps)`` trains a fresh model on a synthetic regression task for a few steps and returns
the losses. In the tests the gradwatch pytest plugin watches the model (nothing here refers to
it); run this file on its own to watch it yourself::

    python smoke_train.py --steps 200 --run runs/smoke
    gradwatch check runs/smoke
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

FEATURES = 8


class Regressor(nn.Module):
    """A two-layer MLP: ``fc1`` -> ``act`` (Tanh) -> ``fc2``."""

    def __init__(self, features: int = FEATURES, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def batches(steps: int, *, batch_size: int = 32, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of a fixed noisy linear target, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(FEATURES, 1, generator=generator)
    for _ in range(steps):
        x = torch.randn(batch_size, FEATURES, generator=generator)
        yield x, x @ weight + 0.1 * torch.randn(batch_size, 1, generator=generator)


def train(steps: int, run: str | Path | None = None, *, lr: float = 0.05, seed: int = 0) -> list[float]:
    """Train a fresh :class:`Regressor` for ``steps`` optimizer steps.

    Args:
        steps: optimizer steps.
        run: watch the model with gradwatch into this run directory; None leaves watching to
            the caller (in the tests, the gradwatch pytest plugin).
        lr: SGD learning rate.
        seed: seeds the model and the data.

    Returns:
        The loss of every step.
    """
    torch.manual_seed(seed)
    model = Regressor()
    watcher = None
    if run is not None:
        import gradwatch as gw

        watcher = gw.watcher(gw.watch(model, run=run, overwrite=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches(steps, seed=seed):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if watcher is not None:
            watcher.observe(loss=loss)
        optimizer.step()
        losses.append(loss.item())
    if watcher is not None:
        watcher.close()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--run", default="runs/smoke", help="run directory (default: runs/smoke)")
    args = parser.parse_args()
    losses = train(args.steps, run=args.run)
    print(f"{args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; run in {args.run}")
