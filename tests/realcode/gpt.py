"""A GPT trainer in the style of the widely copied minimal GPT training scripts.

Decoder-only transformer with tied token embedding / output head, pre-LayerNorm blocks,
causal self-attention written out by hand (mask + softmax), AdamW with decay / no-decay
parameter groups, linear warmup then cosine decay set by hand on every step, gradient
accumulation over micro-batches, autocast (bf16 or fp16 + GradScaler) and ``clip_grad_norm_``.
The data is a fixed random Markov chain over a small vocabulary (4 equally likely successors
per token: the best loss is ln 4 = 1.39, a fresh model starts near ln 64 = 4.16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from . import Result, attach, detach

PAD = 0  # the padding token id


@dataclass
class Config:
    # model
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 48
    block_size: int = 32
    vocab_size: int = 64
    dropout: float = 0.1
    # training
    batch_size: int = 8
    gradient_accumulation_steps: int = 2
    max_iters: int = 60
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "bfloat16"  # "float32", "bfloat16" or "float16" (fp16 trains with a GradScaler)
    seed: int = 1337
    # plants
    lr_scale: float = 1.0  # the learning rate actually used is learning_rate * lr_scale
    clip_always: bool = False  # calls clip_grad_norm_(..., grad_clip) even when grad_clip == 0
    pad_at: int | None = None  # this iteration's first batch holds a left-padded sample with a key padding mask
    left_out: str | None = None  # configure_optimizers forgets the parameters whose name ends with this
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        causal = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal", causal.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        allowed = self.causal[:, :, :T, :T]
        if keep is not None:  # key padding: a query may not look at padding tokens
            allowed = allowed & keep[:, None, None, :]
        att = att.masked_fill(~allowed, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, keep)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             left_out: str | None = None) -> torch.optim.Optimizer:
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        if left_out is not None:  # the bug: a name filter that silently drops some parameters
            params = {name: p for name, p in params.items() if not name.endswith(left_out)}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def markov_chain(vocab: int, seed: int) -> torch.Tensor:
    """Each token's 4 possible successors (never the padding token)."""
    return torch.randint(1, vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))


def get_batch(cfg: Config, it: int, micro: int, chain: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A batch of sequences from the chain; at iteration ``cfg.pad_at``, one left-padded sample and the mask."""
    g = torch.Generator().manual_seed(1_000 * it + micro)
    seq = torch.empty(cfg.batch_size, cfg.block_size + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(1, cfg.vocab_size, (cfg.batch_size,), generator=g)
    choice = torch.randint(0, 4, (cfg.batch_size, cfg.block_size), generator=g)
    for t in range(cfg.block_size):
        seq[:, t + 1] = chain[seq[:, t], choice[:, t]]
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    if it != cfg.pad_at or micro != 0:
        return x, y, None
    # a shorter sample left-padded to the block size, with a key padding mask: position 0
    # of that sample is padding, so its first query has nothing it may attend to
    x[0, :4], y[0, :4] = PAD, -1
    return x, y, x != PAD


def get_lr(cfg: Config, it: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr``."""
    lr, min_lr = cfg.learning_rate * cfg.lr_scale, cfg.min_lr * cfg.lr_scale
    if it < cfg.warmup_iters:
        return lr * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.max_iters:
        return min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    chain = markov_chain(cfg.vocab_size, cfg.seed)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate * cfg.lr_scale,
                                           (cfg.beta1, cfg.beta2), cfg.left_out)
    scaler = torch.amp.GradScaler("cpu", enabled=(cfg.dtype == "float16"))
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    ctx = torch.autocast("cpu", dtype=ptdtype, enabled=cfg.dtype != "float32")
    observe = attach(model, cfg.run, **cfg.watch)
    losses, norms = [], []
    try:
        for it in range(cfg.max_iters):
            lr = get_lr(cfg, it)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            total = torch.zeros(())
            for micro_step in range(cfg.gradient_accumulation_steps):
                X, Y, keep = get_batch(cfg, it, micro_step, chain)
                with ctx:
                    _, loss = model(X, Y, keep)
                    assert loss is not None
                    loss = loss / cfg.gradient_accumulation_steps
                total += loss.detach()
                scaler.scale(loss).backward()
            observe(loss=total)
            if cfg.grad_clip != 0.0 or cfg.clip_always:
                scaler.unscale_(optimizer)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(total))
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"model": model, "norms": norms, "scale": scaler.get_scale()})
