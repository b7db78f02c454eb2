"""A diffusion transformer trained the way the widely copied DiT training script does it.

Patch tokens of a small "latent" (here 16 tokens of 8 channels from 10 fixed class templates plus
noise) embedded by a linear layer plus a frozen sine-cosine position embedding; a sinusoidal
timestep embedder (MLP) plus a class embedding (with a null class for classifier-free guidance
dropout) gives the conditioning vector ``c``. Each block is adaLN-Zero: ``adaLN_modulation =
Sequential(SiLU, Linear(c, 6 * dim))`` zero-initialised, its shift, scale and gate modulating the
attention and MLP branches (``x = x + gate * attn(modulate(norm(x), shift, scale))``); the final
layer's modulation and linear layer are zero-initialised too. The loss is the epsilon-prediction
MSE at a uniformly sampled timestep of a linear beta schedule; ``AdamW`` at 1e-4 without weight
decay, constant, as the paper's recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import Result, compiled_and_watched, detach_watched
from .deit3 import Attention  # timm's ViT attention, which DiT's blocks use too


@dataclass
class Config:
    dim: int = 32
    depth: int = 2
    heads: int = 4
    channels: int = 8
    tokens: int = 16
    num_classes: int = 10
    class_dropout: float = 0.1
    timesteps: int = 1000
    batch_size: int = 32
    steps: int = 200
    lr: float = 1e-4
    warmup_steps: int = 0  # the DiT recipe has none; PixArt-style recipes warm up from 0 per iteration
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the learning rate actually used is lr * lr_scale
    # from this step the loss is weighted by 1/(1 - alpha_bar) on betas from 0; that step's sample 3 draws t = 0: Inf
    t_zero_at: int | None = None
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq: int = 64) -> None:
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def sincos(tokens: int, dim: int) -> torch.Tensor:
    pos = torch.arange(tokens, dtype=torch.float32)[:, None]
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    return torch.cat([torch.sin(pos * omega), torch.cos(pos * omega)], dim=1)[None]


class DiT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(cfg.channels, cfg.dim)
        self.t_embedder = TimestepEmbedder(cfg.dim)
        self.y_embedder = nn.Embedding(cfg.num_classes + 1, cfg.dim)  # the last class is the null class
        self.pos_embed = nn.Parameter(sincos(cfg.tokens, cfg.dim), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(cfg.dim, cfg.heads) for _ in range(cfg.depth)])
        self.final_layer = FinalLayer(cfg.dim, cfg.channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.y_embedder.weight, std=0.02)
        for m in self.t_embedder.mlp:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        zero = [m for name, m in self.named_modules() if name.endswith("adaLN_modulation.1")]  # adaLN-Zero
        zero.append(self.final_layer.linear)  # and the final layer
        for m in zero:
            assert isinstance(m, nn.Linear)
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.final_layer(x, c)


def batch(cfg: Config, step: int, templates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90_000 + step)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g)
    return templates[y] + 0.1 * torch.randn(cfg.batch_size, cfg.tokens, cfg.channels, generator=g), y


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    seeded = torch.Generator().manual_seed(cfg.seed + 1)
    templates = torch.randn(cfg.num_classes, cfg.tokens, cfg.channels, generator=seeded)
    model = DiT(cfg)
    net, observe = compiled_and_watched(model, cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr * cfg.lr_scale, weight_decay=0.0)
    warmup = (lambda it: min(1.0, it / cfg.warmup_steps)) if cfg.warmup_steps else (lambda it: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    betas = torch.linspace(1e-4, 0.02, cfg.timesteps, dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, 0).float()
    zero_betas = torch.cumprod(1 - torch.linspace(0.0, 0.02, cfg.timesteps, dtype=torch.float64), 0).float()
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            x0, y = batch(cfg, step, templates)
            g = torch.Generator().manual_seed(91_000 + step)
            t = torch.randint(0, cfg.timesteps, (cfg.batch_size,), generator=g)
            drop = torch.rand(cfg.batch_size, generator=g) < cfg.class_dropout
            y = torch.where(drop, torch.full_like(y, cfg.num_classes), y)
            noise = torch.randn(x0.shape, generator=g)
            planted = cfg.t_zero_at is not None and step >= cfg.t_zero_at  # the reweighted loss came with a resume
            if step == cfg.t_zero_at:
                t[3] = 0
            ab = (zero_betas if planted else alphas_cumprod)[t][:, None, None]
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
            err = (net(xt, t, y) - noise) ** 2
            if planted:  # the plant: an x0-weighted loss, 1/(1 - alpha_bar), Inf where t = 0 gives alpha_bar = 1
                loss = (err / (1 - ab)).mean()
            else:
                loss = err.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model})
