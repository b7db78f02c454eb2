"""A sequence-to-sequence ``nn.Transformer`` trained the way the widely copied translation tutorials do.

Source and target token embeddings scaled by sqrt(d_model), sinusoidal positional encodings,
``nn.Transformer`` in the sequence-first layout (``batch_first=False``), a linear generator; the
masks built per batch: a causal target mask and source / target padding masks (memory padding
from the source's). Teacher forcing: the decoder reads ``tgt[:-1]`` and predicts ``tgt[1:]``,
``CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)``; ``Adam(betas=(0.9, 0.98),
eps=1e-9)`` at base lr 1.0 under a Noam ``LambdaLR`` (linear warmup, then inverse square root)
stepped on every iteration. The "translation" is generated: a random sentence of 2 to
``max_len`` tokens, reversed, with BOS / EOS around the target and padding to the batch's
longest sentence (the targets to a fixed length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import Result, compiled_and_watched, detach_watched

PAD, BOS, EOS = 0, 1, 2  # special token ids; the words are 3 .. vocab_size - 1


@dataclass
class Config:
    vocab_size: int = 16
    d_model: int = 32
    nhead: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    dim_feedforward: int = 64
    dropout: float = 0.1
    max_len: int = 8  # the longest source sentence
    batch_size: int = 32
    steps: int = 200
    noam_factor: float = 0.5  # the peak lr is factor / sqrt(d_model * warmup)
    warmup: int = 40
    label_smoothing: float = 0.1
    seed: int = 0
    # plants
    lr_scale: float = 1.0  # the Noam factor actually used is noam_factor * lr_scale
    blank_targets_at: int | None = None  # this step's batch has blank target lines: its targets are all padding
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    compile: str | None = None  # "compile-watched": torch.compile(gw.watch(model)); "watch-compiled": the other order


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float, max_positions: int = 64) -> None:
        super().__init__()
        div = torch.exp(-torch.arange(0, d_model, 2) * math.log(10000.0) / d_model)
        position = torch.arange(max_positions).unsqueeze(1)
        table = torch.zeros(max_positions, 1, d_model)
        table[:, 0, 0::2] = torch.sin(position * div)
        table[:, 0, 1::2] = torch.cos(position * div)
        self.dropout = nn.Dropout(dropout)
        self.table: torch.Tensor
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (seq, batch, d_model)
        return self.dropout(x + self.table[: x.size(0)])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) * self.scale


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.transformer = nn.Transformer(d_model=cfg.d_model, nhead=cfg.nhead,
                                          num_encoder_layers=cfg.num_encoder_layers,
                                          num_decoder_layers=cfg.num_decoder_layers,
                                          dim_feedforward=cfg.dim_feedforward, dropout=cfg.dropout)
        self.src_tok_emb = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.tgt_tok_emb = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.positional_encoding = PositionalEncoding(cfg.d_model, cfg.dropout)
        self.generator = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor,
                src_padding_mask: torch.Tensor, tgt_padding_mask: torch.Tensor) -> torch.Tensor:
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(tgt))
        outs = self.transformer(src_emb, tgt_emb, tgt_mask=tgt_mask, src_key_padding_mask=src_padding_mask,
                                tgt_key_padding_mask=tgt_padding_mask, memory_key_padding_mask=src_padding_mask)
        return self.generator(outs)


def create_mask(src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The causal target mask (bool, True = may not attend) and the padding masks, batch first."""
    tgt_len = tgt.size(0)
    tgt_mask = torch.triu(torch.ones(tgt_len, tgt_len, dtype=torch.bool), diagonal=1)
    return tgt_mask, (src == PAD).transpose(0, 1), (tgt == PAD).transpose(0, 1)


def pad_sequences(lines: list[list[int]], length: int | None = None) -> torch.Tensor:
    """(length, batch), padded with PAD (to the longest line when ``length`` is None)."""
    longest = max(len(line) for line in lines) if length is None else length
    out = torch.full((longest, len(lines)), PAD, dtype=torch.long)
    for i, line in enumerate(lines):
        out[: len(line), i] = torch.tensor(line, dtype=torch.long)
    return out


def collate(pairs: list[tuple[list[int], list[int]]], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Special tokens around each non-empty target line, then padding (sequence first): the sources
    to the batch's longest, the targets to the fixed ``max_len + 2``."""
    src = [s for s, _ in pairs]
    tgt = [[BOS] + t + [EOS] if t else [] for _, t in pairs]
    return pad_sequences(src), pad_sequences(tgt, max_len + 2)


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (sentence, reversed sentence) pairs of 2 to ``max_len`` words."""
    g = torch.Generator().manual_seed(10_000 * cfg.seed + step)
    lengths = torch.randint(2, cfg.max_len + 1, (cfg.batch_size,), generator=g).tolist()
    pairs = []
    for n in lengths:
        words = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        target = [] if step == cfg.blank_targets_at else words[::-1]  # the plant: a shard whose target side is blank
        pairs.append((words, target))
    return collate(pairs, cfg.max_len)


def noam(d_model: int, warmup: int, factor: float) -> Any:
    def rate(step: int) -> float:
        step = max(step, 1)
        return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    return rate


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    model = Seq2SeqTransformer(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=cfg.label_smoothing)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda=lambda step: noam(cfg.d_model, cfg.warmup, cfg.noam_factor * cfg.lr_scale)(step + 1))
    net, observe = compiled_and_watched(model, cfg)
    losses = []
    try:
        model.train()
        for step in range(cfg.steps):
            src, tgt = batch(cfg, step)
            tgt_input = tgt[:-1, :]
            tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
            logits = net(src, tgt_input, tgt_mask, src_padding_mask, tgt_padding_mask)
            optimizer.zero_grad()
            tgt_out = tgt[1:, :]
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
            loss.backward()
            observe(loss=loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    finally:
        detach_watched(model, net, cfg)
    return Result(losses, cfg.run, {"model": model})
