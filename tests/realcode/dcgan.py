"""A DCGAN trained the way the widely copied PyTorch DCGAN example does it.

A generator of transposed convolutions (BatchNorm, ReLU, Tanh) and a discriminator of strided
convolutions (LeakyReLU 0.2, BatchNorm, Sigmoid), both initialised from N(0, 0.02) (BatchNorm
weights from N(1, 0.02)); ``nn.BCELoss``; Adam at 2e-4 with betas (0.5, 0.999) for each; per
iteration the discriminator steps on a real batch (label 1) and a detached fake one (label 0),
then the generator steps on the discriminator's verdict on the same fakes (label 1). Both models
are watched, each into its own run (``run/D`` and ``run/G``), and each observes its own loss.
The "images" are 32x32 soft blobs: each sample is one or two Gaussian bumps at random places,
scaled to [-1, 1] as the example's ``Normalize`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import Result, attach, detach


@dataclass
class Config:
    batch_size: int = 32
    nz: int = 16  # size of the latent vector
    ngf: int = 16
    ndf: int = 16
    lr: float = 2e-4
    beta1: float = 0.5
    steps: int = 60
    real_label: float = 1.0  # 0.9: one-sided label smoothing
    seed: int = 0
    # plants
    lr_d_scale: float = 1.0  # the discriminator's learning rate times this (a typo: 2e-1 for 2e-4)
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


def weights_init(m: nn.Module) -> None:
    """Custom weights initialization called on netG and netD."""
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, nz: int, ngf: int, nc: int = 1) -> None:
        super().__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 4 x 4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 16 x 16
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
            # state size. (nc) x 32 x 32
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf: int, nc: int = 1) -> None:
        super().__init__()
        self.main = nn.Sequential(
            # input is (nc) x 32 x 32
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 16 x 16
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 8 x 8
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*4) x 4 x 4
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


def real_batch(cfg: Config, step: int) -> torch.Tensor:
    """One or two soft Gaussian blobs per 32x32 image, in [-1, 1]."""
    g = torch.Generator().manual_seed(70_000 + step)
    n = cfg.batch_size
    grid = torch.arange(32, dtype=torch.float32)
    centers = 6 + 20 * torch.rand(n, 2, 2, generator=g)  # (sample, blob, yx)
    width = 2.0 + 2.0 * torch.rand(n, 2, 1, 1, generator=g)
    dy = (grid.view(1, 1, 32, 1) - centers[..., 0, None, None]) ** 2
    dx = (grid.view(1, 1, 1, 32) - centers[..., 1, None, None]) ** 2
    blobs = torch.exp(-(dy + dx) / (2 * width**2))  # (n, 2, 32, 32)
    second = (torch.rand(n, 1, 1, generator=g) < 0.5).float()
    image = (blobs[:, 0] + second * blobs[:, 1]).clamp(max=1.0)
    return (image * 2 - 1).unsqueeze(1)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    netG = Generator(cfg.nz, cfg.ngf)
    netG.apply(weights_init)
    netD = Discriminator(cfg.ndf)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    fake_label = 0.0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=cfg.lr * cfg.lr_d_scale, betas=(cfg.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=cfg.lr, betas=(cfg.beta1, 0.999))
    observe_d = attach(netD, None if cfg.run is None else cfg.run / "D", **cfg.watch)
    observe_g = attach(netG, None if cfg.run is None else cfg.run / "G", **cfg.watch)
    losses_d, losses_g = [], []
    try:
        for i in range(cfg.steps):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real_cpu = real_batch(cfg, i)
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), cfg.real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            # train with fake
            noise = torch.randn(batch_size, cfg.nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            errD = errD_real + errD_fake
            observe_d(loss=errD)
            optimizerD.step()
            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(1.0)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            observe_g(loss=errG)
            optimizerG.step()
            losses_d.append(errD.item())
            losses_g.append(errG.item())
    finally:
        detach(netG, None if cfg.run is None else cfg.run / "G")
        detach(netD, None if cfg.run is None else cfg.run / "D")
    runs = {} if cfg.run is None else {"D": cfg.run / "D", "G": cfg.run / "G"}
    return Result(losses_d, cfg.run, {"generator_losses": losses_g, "runs": runs, "netG": netG, "netD": netD})
