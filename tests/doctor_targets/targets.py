"""Factories for ``gradwatch doctor`` tests: each returns ``(model, batch, loss_fn)``."""

from __future__ import annotations

import torch
from torch import nn

IN, CLASSES, BATCH = 16, 4, 32


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def mlp() -> nn.Sequential:
    """A small ReLU MLP that fits one batch of 32 in well under 100 Adam steps at lr 1e-3."""
    return nn.Sequential(nn.Linear(IN, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def healthy() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A model with nothing wrong."""
    torch.manual_seed(0)
    return mlp(), _batch(), nn.functional.cross_entropy


class WithUnusedHead(nn.Module):
    """A classifier whose second head is built but never used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.aux_head = nn.Linear(CLASSES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A model with an unused submodule."""
    torch.manual_seed(0)
    return WithUnusedHead(), _batch(), nn.functional.cross_entropy


def junk() -> tuple[nn.Module, torch.Tensor]:
    """Returns two items instead of three."""
    return mlp(), torch.zeros(2, IN)


def not_a_model() -> tuple[str, torch.Tensor, None]:
    """Returns a string where the model belongs."""
    return "model", torch.zeros(2, IN), None


def bad_batch() -> tuple[nn.Module, tuple[torch.Tensor, str], object]:
    """Returns a batch holding a string."""
    return mlp(), (torch.zeros(2, IN), "labels"), nn.functional.cross_entropy


def raises() -> None:
    """Fails while building the model."""
    raise RuntimeError("checkpoint weights.pt not found\nsecond line")


def unreduced() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A loss_fn that forgets to reduce: the loss is a vector."""
    return mlp(), _batch(), lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")


NOT_CALLABLE = 3
