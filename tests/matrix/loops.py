"""The matrix's building blocks: seeded batches, a supervised loop, and the way a NaN is planted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.matrix import Loop, Observe

Batch = tuple[Any, torch.Tensor]


def batch(i: int, n: int = 16, features: int = 4, dtype: torch.dtype = torch.float32) -> Batch:
    """Iteration ``i``'s batch of a small regression problem (the same batch for the same ``i``)."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    y = (x[:, :2].sum(1, keepdim=True) + 0.1 * x[:, 2:3] ** 2)
    if dtype.is_complex:
        x, y = x.to(dtype) * (1 + 0.5j), y.to(dtype)
    return x.to(dtype), y.to(dtype)


def poisoned(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a NaN in its first element, the way a bad sample brings one in."""
    x = x.clone()
    x[(0,) * x.dim()] = float("nan")
    return x


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error, real for complex outputs (``|out - y|^2``), in float32 or wider."""
    diff = out - y
    if diff.is_complex():
        return (diff.real ** 2 + diff.imag ** 2).mean()
    return diff.pow(2).mean()


def supervised(model: nn.Module, *, dtype: torch.dtype = torch.float32, lr: float = 0.05,
               optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
               data: Callable[[int], Batch] | None = None,
               forward: Callable[[nn.Module, Any], torch.Tensor] | None = None,
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse, scale: float = 1.0,
               poison: Callable[[Any], Any] = poisoned) -> Loop:
    """The loop most people write: batch, forward, loss, ``zero_grad``, ``backward``, ``observe``, ``step``.

    Args:
        model: the module trained (and watched).
        dtype: the batches' dtype (when ``data`` is not given).
        lr: SGD's learning rate (when ``optimizer`` is not given).
        optimizer: builds the optimizer from the model.
        data: iteration -> (inputs, targets).
        forward: (model, inputs) -> outputs (default: ``model(inputs)``).
        loss: (outputs, targets) -> the loss.
        scale: the loss is multiplied by it (gradients at the edge of a dtype).
        poison: inputs -> inputs holding a NaN, for the planted step.
    """
    opt = optimizer(model) if optimizer else torch.optim.SGD(model.parameters(), lr=lr)
    data = data or (lambda i: batch(i, dtype=dtype))
    forward = forward or (lambda m, x: m(x))

    def step(i: int, poison_it: bool, observe: Observe) -> None:
        x, y = data(i)
        if poison_it:
            x = poison(x)
        out = forward(model, x)
        value = loss(out, y) * scale
        opt.zero_grad()
        value.backward()
        observe(loss=value)
        opt.step()

    return Loop(model, step)


def mlp(dtype: torch.dtype = torch.float32, features: int = 4, hidden: int = 16, act: type[nn.Module] = nn.Tanh,
        out: int = 1) -> nn.Sequential:
    """A small MLP in ``dtype``."""
    return nn.Sequential(nn.Linear(features, hidden), act(), nn.Linear(hidden, hidden), act(),
                         nn.Linear(hidden, out)).to(dtype)
