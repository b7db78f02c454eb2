"""Matrix axis: autograd APIs — backward, autograd.grad, double backward, retain_graph, checkpoints, torch.func."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.matrix import Cell, Loop, Observe
from tests.matrix.loops import batch, mlp, mse, poisoned, supervised


def _data(i: int, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(i)
    return (poisoned(x) if poison else x), y


def autograd_grad() -> Loop:
    """``torch.autograd.grad`` of the parameters, written into ``.grad`` by hand, then ``step()``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)
        loss = mse(model(x), y)
        params = list(model.parameters())
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.grad = g
        observe(loss=loss)
        opt.step()

    return Loop(model, step)


def double_backward() -> Loop:
    """A gradient penalty (WGAN-GP's): the input gradient with ``create_graph=True``, then ``backward``."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)
        x.requires_grad_(True)
        out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = mse(out, y) + 0.1 * (gx.norm(dim=1) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        observe(loss=loss)
        opt.step()

    return Loop(model, step)


def retain_graph() -> Loop:
    """Two losses of one forward pass, each with its own ``backward`` (the first with ``retain_graph``)."""
    model = mlp(out=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)
        out = model(x)
        opt.zero_grad()
        first = mse(out[:, :1], y)
        first.backward(retain_graph=True)
        second = 0.5 * mse(out[:, 1:], -y)
        second.backward()
        observe(loss=first + second)
        opt.step()

    return Loop(model, step)


class Blocks(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def checkpointed(reentrant: bool) -> Loop:
    return supervised(Blocks(reentrant), lr=0.02)


def func_per_sample() -> Loop:
    """DP-SGD's per-sample gradients: ``vmap(grad(functional_call(model, ...)))``, clipped and averaged
    into ``.grad`` by hand, then ``step()``; every fourth iteration a plain ``backward``."""
    from torch.func import functional_call, grad, vmap

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mse(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)
        if i % 4 == 3:
            loss = mse(model(x), y)
            opt.zero_grad()
            loss.backward()
        else:
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
            for name, p in model.named_parameters():
                g = per_sample[name]
                norms = g.flatten(1).norm(dim=1).clamp(min=1.0)
                p.grad = (g / norms.view(-1, *[1] * (g.dim() - 1))).mean(0)
            with torch.no_grad():
                loss = mse(model(x), y)
        observe(loss=loss)
        opt.step()

    return Loop(model, step)


def func_jacrev() -> Loop:
    """A Jacobian penalty with ``torch.func.jacrev`` over the model itself, then ``backward``."""
    from torch.func import jacrev, vmap

    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)
        jac = vmap(jacrev(lambda v: model(v.unsqueeze(0)).squeeze(0)))(x[:4])
        loss = mse(model(x), y) + 1e-3 * jac.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        observe(loss=loss)
        opt.step()

    return Loop(model, step)


def lbfgs() -> Loop:
    """L-BFGS with a closure that recomputes the loss (the PyTorch time-series example's loop)."""
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = _data(i, poison)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        loss = opt.step(closure)
        observe(loss=loss)

    return Loop(model, step)


CELLS = [
    Cell("autograd/backward", lambda: supervised(mlp())),
    Cell("autograd/autograd-grad-into-grad", autograd_grad),
    Cell("autograd/double-backward-gradient-penalty", double_backward),
    Cell("autograd/retain-graph-two-backwards", retain_graph),
    *[Cell(f"autograd/checkpoint-reentrant-{r}", lambda r=r: checkpointed(r)) for r in (True, False)],
    Cell("autograd/torch-func-vmap-grad-functional-call", func_per_sample),
    Cell("autograd/torch-func-jacrev", func_jacrev),
    Cell("autograd/lbfgs-closure", lbfgs, reference=False),
]
