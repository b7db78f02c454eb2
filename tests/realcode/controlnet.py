"""ControlNet-style training the way the widely copied ControlNet scripts do it.

A small "pretrained" conv encoder-decoder denoiser (random weights, frozen) is given a trainable
copy of its encoder (``control_model``, initialised from the frozen encoder's weights) that reads
the noisy image plus a condition (an edge-like hint map through a small hint block ending in a
zero-initialised conv); each level of the copy's features passes a zero-initialised 1x1 conv
(``zero_convs``) and is added to the frozen encoder's skip features before the frozen decoder.
Only the control model trains: ``AdamW`` at 1e-4 (constant, as the recipe), epsilon-prediction
MSE at a uniformly sampled timestep of a linear beta schedule. The images are noisy copies of 10
fixed templates, the hint a thresholded copy of the clean image.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Result, compiled_and_watched, detach_watched


@dataclass
class Config:
    ch: int = 16
    num_classes: int = 10
    timesteps: int = 1000
    batch_size: int = 16
    steps: int = 200
    lr: float = 1e-4
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the learning rate actually used is lr * lr_scale
    hint_by_zero_at: int | None = None  # from this step the hint is divided by its max (no epsilon): 0/0
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None


def zero_module(m: nn.Module) -> nn.Module:
    for p in m.parameters():
        nn.init.zeros_(p)
    return m


class Encoder(nn.Module):
    def __init__(self, in_ch: int, ch: int) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_ch, ch, 3, padding=1)
        self.down1 = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1))
        self.down2 = nn.Sequential(nn.GroupNorm(4, 2 * ch), nn.SiLU(),
                                   nn.Conv2d(2 * ch, 2 * ch, 3, stride=2, padding=1))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> list[torch.Tensor]:
        h0 = self.conv_in(x)
        if extra is not None:
            h0 = h0 + extra
        h1 = self.down1(h0)
        return [h0, h1, self.down2(h1)]


class Decoder(nn.Module):
    def __init__(self, out_ch: int, ch: int) -> None:
        super().__init__()
        self.mid = nn.Sequential(nn.GroupNorm(4, 2 * ch), nn.SiLU(), nn.Conv2d(2 * ch, 2 * ch, 3, padding=1))
        self.up2 = nn.ConvTranspose2d(4 * ch, 2 * ch, 4, stride=2, padding=1)
        self.up1 = nn.ConvTranspose2d(4 * ch, ch, 4, stride=2, padding=1)
        self.out = nn.Sequential(nn.GroupNorm(4, 2 * ch), nn.SiLU(), nn.Conv2d(2 * ch, out_ch, 3, padding=1))

    def forward(self, hs: list[torch.Tensor]) -> torch.Tensor:
        h = self.mid(hs[2])
        h = F.silu(self.up2(torch.cat([h, hs[2]], 1)))
        h = F.silu(self.up1(torch.cat([h, hs[1]], 1)))
        return self.out(torch.cat([h, hs[0]], 1))


class ControlModel(nn.Module):
    def __init__(self, encoder: Encoder, ch: int) -> None:
        super().__init__()
        self.input_hint_block = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1),
                                              nn.SiLU(), zero_module(nn.Conv2d(8, ch, 3, padding=1)))
        self.encoder = copy.deepcopy(encoder)
        self.zero_convs = nn.ModuleList([zero_module(nn.Conv2d(c, c, 1)) for c in (ch, 2 * ch, 2 * ch)])

    def forward(self, x: torch.Tensor, hint: torch.Tensor) -> list[torch.Tensor]:
        hs = self.encoder(x, self.input_hint_block(hint))
        return [zc(h) for zc, h in zip(self.zero_convs, hs, strict=True)]


class ControlledDenoiser(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.t_embed = nn.Embedding(cfg.timesteps, 4)
        self.encoder = Encoder(3 + 4, cfg.ch)
        self.decoder = Decoder(3, cfg.ch)
        self.requires_grad_(False)  # the pretrained model is locked
        self.control_model = ControlModel(self.encoder, cfg.ch)
        self.control_model.requires_grad_(True)

    def forward(self, x: torch.Tensor, t: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, self.t_embed(t)[:, :, None, None].expand(-1, -1, *x.shape[2:])], 1)
        control = self.control_model(x, hint)
        hs = [h + c for h, c in zip(self.encoder(x), control, strict=True)]
        return self.decoder(hs)


def batch(cfg: Config, step: int, templates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50_000 + step)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g)
    x0 = templates[y] + 0.1 * torch.randn(cfg.batch_size, 3, 16, 16, generator=g)
    return x0, (x0.mean(1, keepdim=True) > 0).float()


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    templates = torch.randn(cfg.num_classes, 3, 16, 16, generator=torch.Generator().manual_seed(cfg.seed + 1))
    model = ControlledDenoiser(cfg)
    net, observe = compiled_and_watched(model, cfg)
    params = list(model.control_model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr * cfg.lr_scale)
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, cfg.timesteps, dtype=torch.float64), 0).float()
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            x0, hint = batch(cfg, step, templates)
            if cfg.hint_by_zero_at is not None and step >= cfg.hint_by_zero_at:
                hint = hint * (x0.mean(1, keepdim=True) > 5).float()  # a threshold that leaves nothing
                hint = hint / hint.amax(dim=(1, 2, 3), keepdim=True)  # the plant: per-image max normalisation, 0/0
            g = torch.Generator().manual_seed(51_000 + step)
            t = torch.randint(0, cfg.timesteps, (cfg.batch_size,), generator=g)
            noise = torch.randn(x0.shape, generator=g)
            ab = alphas_cumprod[t][:, None, None, None]
            loss = F.mse_loss(net(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t, hint), noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model})
