"""Shared fixtures: seeded torch, a fresh run directory, and a plain training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_leftover_watchers() -> Iterator[None]:
    """Every test leaves no model watched behind (and its runs closed)."""
    yield
    from gradwatch import registry

    for watcher in list(registry._live):
        watcher.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def train(
    model: nn.Module,
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int,
    optimizer: torch.optim.Optimizer | None = None,
    observe: bool = True,
) -> torch.optim.Optimizer:
    """An ordinary training loop: zero_grad, forward, backward, observe(loss), step."""
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = batches()
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if observe:
            gw.watcher(model).observe(loss=loss)
        opt.step()
    return opt
