"""Matrix axis: training styles — layer-local losses with an optimizer per layer, GANs, updates by hand, and more."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.matrix import Cell, Loop, Observe
from tests.matrix.loops import batch, mlp, mse, poisoned, supervised


class LocalLayer(nn.Linear):
    """A forward-forward layer: normalises its input, trains on its own "goodness" loss with its own optimizer."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__(features, out)
        self.act = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.act(super().forward(x / (x.norm(dim=1, keepdim=True) + 1e-4)))


class ForwardForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LocalLayer(4, 16), LocalLayer(16, 16)])


def forward_forward() -> Loop:
    """Hinton's forward-forward: each layer pushes its goodness up on positive and down on negative data."""
    model = ForwardForward()

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, _ = batch(i)
        pos, neg = x, x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))].flip(1)
        if poison:
            pos = poisoned(pos)
        total = 0.0
        for layer in model.layers:
            gp, gn = layer(pos).pow(2).mean(1), layer(neg).pow(2).mean(1)
            loss = F.softplus(torch.cat([2.0 - gp, gn - 2.0])).mean()
            layer.opt.zero_grad()
            loss.backward()
            layer.opt.step()
            pos, neg = layer(pos).detach(), layer(neg).detach()
            total = total + loss.detach()
        observe(loss=total)

    return Loop(model, step)


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def gan() -> Loop:
    """A GAN on a 2-D Gaussian: the discriminator's step, then the generator's, each with its own Adam; the
    discriminator watched (the generator's loss goes back through it: gradients left by another's step)."""
    model = GAN()
    g_opt = torch.optim.Adam(model.generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))

    def step(i: int, poison: bool, observe: Observe) -> None:
        g = torch.Generator().manual_seed(8000 + i)
        real = torch.randn(32, 2, generator=g) * 0.5 + torch.tensor([1.0, -1.0])
        if poison:
            real = poisoned(real)
        fake = model.generator(torch.randn(32, 2, generator=g))
        ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
        d_loss = (F.binary_cross_entropy_with_logits(model.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros))
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        g_loss = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
        observe(g_loss=g_loss, d_loss=d_loss)

    return Loop(model.discriminator, step)


def by_hand() -> Loop:
    """No optimizer: ``p.data.add_(p.grad, alpha=-lr)`` after ``backward`` (the word-language-model example)."""
    model = mlp()

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = batch(i)
        if poison:
            x = poisoned(x)
        model.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        observe(loss=loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.05)

    return Loop(model, step)


def accumulation() -> Loop:
    """Four micro-batches per optimizer step, the loss divided by four, clipped, with a cosine schedule."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 24)

    def step(i: int, poison: bool, observe: Observe) -> None:
        x, y = batch(i, n=32)
        if poison:
            x = poisoned(x)
        for part in range(4):
            loss = mse(model(x[part * 8:(part + 1) * 8]), y[part * 8:(part + 1) * 8]) / 4
            loss.backward()
            observe(loss=loss * 4)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return Loop(model, step)


def ema() -> Loop:
    """An exponential moving average of the weights beside the trained model (``AveragedModel``)."""
    model = mlp()
    averaged = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    inner = supervised(model, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=3e-3))

    def step(i: int, poison: bool, observe: Observe) -> None:
        inner.step(i, poison, observe)
        averaged.update_parameters(model)

    return Loop(model, step)


def batchnorm_dropout() -> Loop:
    """BatchNorm and Dropout in train mode, an eval pass every eighth step (validation with gradients on)."""
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    inner = supervised(model, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))

    def step(i: int, poison: bool, observe: Observe) -> None:
        inner.step(i, poison, observe)
        if i % 8 == 7:
            model.eval()
            with torch.no_grad():
                model(batch(i + 100)[0])
            model.train()

    return Loop(model, step)


CELLS = [
    Cell("styles/forward-forward-optimizer-per-layer", forward_forward, reference=False),
    Cell("styles/gan-two-optimizers-discriminator-watched", gan, reference=False),
    Cell("styles/manual-sgd-without-optimizer", by_hand, reference=False),
    Cell("styles/accumulation-clip-cosine-schedule", accumulation),
    Cell("styles/ema-averaged-model", ema),
    Cell("styles/batchnorm-dropout-eval-pass", batchnorm_dropout),
]
