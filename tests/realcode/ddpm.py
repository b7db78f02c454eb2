"""A denoising diffusion model (DDPM) trained the way the widely copied DDPM training scripts do it.

A small UNet (residual blocks with GroupNorm and SiLU, the timestep's sinusoidal embedding through
an MLP added in every block, one downsampling and one upsampling level with a skip connection)
predicts the noise added to an image at a random timestep of a linear beta schedule (1e-4 to
0.02 over ``timesteps`` steps); the loss is the MSE between predicted and true noise, weighted per
sample by min-SNR-gamma (``min(snr, gamma) / snr``, as the diffusers training scripts'
``--snr_gamma`` does). AdamW with a linear warmup, ``clip_grad_norm_(1.0)``, and an EMA copy of
the weights kept with ``torch.optim.swa_utils.AveragedModel``. The images are 16x16 soft blobs in
[-1, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from . import Result, attach, detach


@dataclass
class Config:
    batch_size: int = 16
    timesteps: int = 100
    lr: float = 1e-3
    warmup_steps: int = 10
    snr_gamma: float = 5.0
    ema_decay: float = 0.99
    steps: int = 40
    seed: int = 0
    # plants
    zero_terminal_snr: bool = False  # the schedule rescaled to a zero terminal SNR ("Common Diffusion Noise
    # Schedules and Sample Steps are Flawed") while min-SNR weighting divides by the SNR: 0/0 at the last timestep
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10_000) -> torch.Tensor:
    """Sinusoidal embeddings of the (integer) timesteps, as in the DDPM and transformer papers."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, time_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time = nn.Linear(time_dim, out_ch)
        self.norm2 = nn.GroupNorm(4, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class UNet(nn.Module):
    def __init__(self, ch: int = 8, time_dim: int = 32) -> None:
        super().__init__()
        self.ch = ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))
        self.conv_in = nn.Conv2d(1, ch, 3, padding=1)
        self.down1 = ResBlock(ch, ch, time_dim)
        self.downsample = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.down2 = ResBlock(2 * ch, 2 * ch, time_dim)
        self.mid = ResBlock(2 * ch, 2 * ch, time_dim)
        self.upsample = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(2 * ch, ch, 3, padding=1))
        self.up1 = ResBlock(2 * ch, ch, time_dim)
        self.norm_out = nn.GroupNorm(4, ch)
        self.conv_out = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_embedding(t, self.ch))
        h1 = self.down1(self.conv_in(x), emb)
        h = self.mid(self.down2(self.downsample(h1), emb), emb)
        h = self.up1(torch.cat([self.upsample(h), h1], dim=1), emb)
        return self.conv_out(F.silu(self.norm_out(h)))


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Rescale a schedule so that its last timestep is pure noise (its SNR is 0)."""
    alphas_bar_sqrt = torch.cumprod(1 - betas, 0).sqrt()
    first, last = alphas_bar_sqrt[0].clone(), alphas_bar_sqrt[-1].clone()
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * first / (first - last)
    alphas_bar = alphas_bar_sqrt**2
    alphas = torch.cat([alphas_bar[0:1], alphas_bar[1:] / alphas_bar[:-1]])
    return 1 - alphas


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16x16 images of one soft Gaussian blob at a random place, in [-1, 1]; their noise and timesteps."""
    g = torch.Generator().manual_seed(80_000 + step)
    grid = torch.arange(16, dtype=torch.float32)
    center = 3 + 10 * torch.rand(cfg.batch_size, 2, generator=g)
    width = 1.5 + torch.rand(cfg.batch_size, 1, 1, generator=g)
    d2 = (grid.view(1, 16, 1) - center[:, 0, None, None]) ** 2 + (grid.view(1, 1, 16) - center[:, 1, None, None]) ** 2
    clean = (2 * torch.exp(-d2 / (2 * width**2)) - 1).unsqueeze(1)
    return clean, torch.randn(clean.shape, generator=g), torch.randint(0, cfg.timesteps, (cfg.batch_size,), generator=g)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    betas = torch.linspace(1e-4, 0.02, cfg.timesteps)
    if cfg.zero_terminal_snr:
        betas = rescale_zero_terminal_snr(betas)
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    snr_all = alphas_cumprod / (1.0 - alphas_cumprod)
    model = UNet()
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(
        cfg.ema_decay))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    observe = attach(model, cfg.run, **cfg.watch)
    losses: list[float] = []
    terminal: int | None = None  # the first step whose batch drew the last timestep
    try:
        model.train()
        for step in range(cfg.steps):
            clean, noise, timesteps = batch(cfg, step)
            if terminal is None and bool((timesteps == cfg.timesteps - 1).any()):
                terminal = step
            a = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
            noisy = a.sqrt() * clean + (1 - a).sqrt() * noise
            pred = model(noisy, timesteps)
            snr = snr_all[timesteps]
            weights = torch.clamp(snr, max=cfg.snr_gamma) / snr  # min-SNR-gamma
            loss = (F.mse_loss(pred, noise, reduction="none").mean(dim=(1, 2, 3)) * weights).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            observe(loss=loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            ema.update_parameters(model)
            losses.append(loss.item())
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"model": model, "ema": ema, "terminal": terminal})
