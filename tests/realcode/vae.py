"""A variational autoencoder trained the way the widely copied MNIST VAE example does it.

784 -> 400 -> (mu, logvar) of a 20-d latent, reparameterised sample, 20 -> 400 -> 784 with a
sigmoid; the loss is the *summed* (not averaged) binary cross-entropy plus the KL divergence,
so gradient norms are in the thousands on a healthy run. Adam, lr 1e-3, batches of 256.
The "images" are 28x28 binarised noisy strokes: each sample is one of 10 fixed random
prototypes with 10% of its pixels flipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from . import Result, attach, detach


@dataclass
class Config:
    batch_size: int = 256
    lr: float = 1e-3
    steps: int = 40
    seed: int = 1
    # plants
    logvar_bias: float | None = None  # the log-variance head starts at this bias (a variance set in
    # the wrong units): exp(logvar) makes huge but finite values
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """Reconstruction + KL divergence losses summed over all elements and batch."""
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def data(cfg: Config, step: int, protos: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(90_000 + step)
    y = torch.randint(0, len(protos), (cfg.batch_size,), generator=g)
    flip = torch.rand(cfg.batch_size, 784, generator=g) < 0.1
    return torch.where(flip, 1.0 - protos[y], protos[y]).view(-1, 1, 28, 28)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    protos = (torch.rand(10, 784, generator=torch.Generator().manual_seed(cfg.seed + 7)) < 0.2).float()
    model = VAE()
    if cfg.logvar_bias is not None:
        with torch.no_grad():
            model.fc22.bias.fill_(cfg.logvar_bias)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    observe = attach(model, cfg.run, **cfg.watch)
    losses = []
    try:
        model.train()
        for step in range(cfg.steps):
            batch = data(cfg, step, protos)
            optimizer.zero_grad()
            recon_batch, mu, logvar = model(batch)
            loss = loss_function(recon_batch, batch, mu, logvar)
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            losses.append(loss.item() / len(batch))
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"model": model})
