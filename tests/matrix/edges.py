"""Matrix axis: numbers at the edges of each dtype, losses of every sign and of none, structured outputs, run paths."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tests.matrix import Cell, Loop, Observe
from tests.matrix.loops import batch, mlp, mse, poisoned, supervised


class Units(nn.Module):
    """A Linear layer whose weight is stored in units of ``1/scale``: its weight is ``scale`` times the
    usual one and its gradient ``1/scale`` times; trained with the learning rate times ``scale**2``, the
    training is the usual one, at the edge of the dtype's range."""

    def __init__(self, features: int, out: int, scale: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = scale
        init = nn.Linear(features, out).to(dtype)
        self.weight = nn.Parameter(init.weight.detach() * scale)
        self.bias = nn.Parameter(init.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight / self.scale, self.bias)


class WideSGD(torch.optim.Optimizer):
    """Plain SGD whose update is computed in float64: a learning rate beyond the parameters' dtype (a
    bfloat16 weight near 1e36 trained at ``lr * 1e72``) still gives an update the dtype holds."""

    def __init__(self, params, lr: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_((p.grad.to(torch.float64) * group["lr"]).to(p.dtype))


def weights_at(scale: float, dtype: torch.dtype) -> Loop:
    """Every weight near ``scale`` and its gradient near ``1/scale``, in ``dtype``: a healthy training."""
    model = nn.Sequential(Units(4, 16, scale, dtype), nn.Tanh(), Units(16, 1, scale, dtype))
    lr = 0.05

    def optimizer(m: nn.Module) -> torch.optim.Optimizer:
        return WideSGD([{"params": [m[0].weight, m[2].weight], "lr": lr * scale * scale},
                        {"params": [m[0].bias, m[2].bias]}], lr=lr)

    return supervised(model, dtype=dtype, optimizer=optimizer)


def loss_scaled(scale: float, dtype: torch.dtype = torch.float32) -> Loop:
    """Every gradient near ``scale`` (the loss multiplied by it), SGD's learning rate divided by it."""
    return supervised(mlp(dtype), dtype=dtype, lr=0.05 / scale, scale=scale)


class NaiveSoftmax(nn.Module):
    """``exp(z) / exp(z).sum()`` written by hand, with logits offset far up: exp reaches ~1e26, finite."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = torch.exp(z + 60.0)
        return e / e.sum(dim=1, keepdim=True)


def naive_softmax() -> Loop:
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3), NaiveSoftmax())

    def loss(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(torch.log(p), (y[:, 0] > 0).long() + (y[:, 0] > 1).long())

    return supervised(model, loss=loss, lr=0.1)


def negative_loss() -> Loop:
    """A Gaussian negative log-likelihood with a learned variance: the loss goes below 0 and stays there."""
    model = mlp(out=2)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.gaussian_nll_loss(out[:, :1], y, F.softplus(out[:, 1:]) + 1e-3) - 1.0

    return supervised(model, loss=loss, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))


@dataclass
class Prediction:
    mean: torch.Tensor
    spread: torch.Tensor


class DataclassHead(nn.Module):
    """A leaf module whose output is a dataclass of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 16) / 4)

    def forward(self, h: torch.Tensor) -> Prediction:
        out = h @ self.weight.t()
        return Prediction(out[:, :1], F.softplus(out[:, 1:]))


Pair = namedtuple("Pair", ["mean", "spread"])


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.head = DataclassHead()

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        pred = self.head(self.body(x))
        if self.kind == "dict":
            return {"mean": pred.mean, "spread": pred.spread}
        if self.kind == "namedtuple":
            return Pair(pred.mean, pred.spread)
        return pred


def structured(kind: str) -> Loop:
    def loss(out, y: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        mean = out["mean"] if isinstance(out, dict) else out.mean
        spread = out["spread"] if isinstance(out, dict) else out.spread
        return mse(mean, y) + 0.01 * spread.mean()
    return supervised(Structured(kind), loss=loss)


def loss_zero_then_positive() -> Loop:
    """A margin loss whose every sample meets its margin for the first ten steps (loss and gradients exactly
    0), then a harder margin: the loss turns small and positive."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = batch(i)
        if poison:
            x = poisoned(x)
        margin = -100.0 if i < 10 else 0.05
        loss = torch.relu(margin - model(x) * torch.sign(y)).mean()
        opt.zero_grad()
        loss.backward()
        observe(loss=loss)
        opt.step()

    return Loop(model, step)


CELLS = [
    Cell("edges/float32-weights-1e19", lambda: weights_at(1e19, torch.float32)),
    Cell("edges/float32-weights-1e-19", lambda: weights_at(1e-19, torch.float32)),
    Cell("edges/bfloat16-weights-1e36", lambda: weights_at(1e36, torch.bfloat16), tolerance=1e-2),
    Cell("edges/float64-weights-1e30", lambda: weights_at(1e30, torch.float64)),
    Cell("edges/float64-weights-1e-30", lambda: weights_at(1e-30, torch.float64)),
    Cell("edges/float32-gradients-1e-30", lambda: loss_scaled(1e-30)),
    Cell("edges/float32-gradients-1e30", lambda: loss_scaled(1e30)),
    Cell("edges/float16-gradients-1e-3", lambda: loss_scaled(1e-3, torch.float16), tolerance=1e-2),
    Cell("edges/naive-softmax-exp-1e26", naive_softmax),
    Cell("edges/loss-exactly-zero-then-positive", loss_zero_then_positive, plant=14),
    Cell("edges/negative-loss", negative_loss),
    *[Cell(f"edges/structured-output-{kind}", lambda kind=kind: structured(kind))
      for kind in ("dataclass", "dict", "namedtuple")],
    Cell("paths/spaces and non-ascii étude 試験", lambda: supervised(mlp()), run_name="run with spaces étude 試験"),
]
