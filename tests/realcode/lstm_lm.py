"""A word-level LSTM language model in the style of the classic, widely copied example.

Embedding -> dropout -> multi-layer LSTM -> dropout -> linear decoder (optionally tied to the
embedding), trained by truncated backpropagation through time on a corpus cut into ``bptt``-long
chunks with the hidden state carried (detached) from chunk to chunk. Like the original, it clips
with ``clip_grad_norm_`` and updates the parameters *by hand* (``p.data.add_(p.grad,
alpha=-lr)``, no optimizer), dividing the learning rate by 4 when the validation loss stops
improving. ``optimizer="sgd"`` runs the same update through ``torch.optim.SGD`` instead.
The corpus is generated from a fixed random Markov chain over the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import Result, attach, detach


@dataclass
class Config:
    ntokens: int = 100
    emsize: int = 32
    nhid: int = 32
    nlayers: int = 2
    dropout: float = 0.2
    tied: bool = False
    lr: float = 20.0
    clip: float = 0.25
    epochs: int = 2
    batch_size: int = 10
    bptt: int = 20
    corpus_len: int = 8_000
    seed: int = 1111
    optimizer: str = "manual"  # "manual" (p.data.add_) or "sgd" (torch.optim.SGD, same update)
    # plants
    lr_scale: float = 1.0
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5,
                 tie_weights: bool = False) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("when using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.nhid, self.nlayers = nhid, nlayers

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def corpus(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams from a fixed Markov chain (3 successors per word)."""
    g = torch.Generator().manual_seed(cfg.seed)
    successors = torch.randint(0, cfg.ntokens, (cfg.ntokens, 3), generator=g)
    ids = torch.empty(cfg.corpus_len + cfg.corpus_len // 4, dtype=torch.long)
    ids[0] = 0
    picks = torch.randint(0, 3, (len(ids),), generator=g)
    for i in range(1, len(ids)):
        ids[i] = successors[ids[i - 1], picks[i]]
    return ids[: cfg.corpus_len], ids[cfg.corpus_len:]


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def repackage_hidden(h: Any) -> Any:
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def evaluate(model: RNNModel, data: torch.Tensor, cfg: Config, criterion: nn.Module) -> float:
    model.eval()
    total = 0.0
    hidden = model.init_hidden(cfg.batch_size)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, cfg.bptt):
            x, y = get_batch(data, i, cfg.bptt)
            output, hidden = model(x, hidden)
            hidden = repackage_hidden(hidden)
            total += len(x) * criterion(output, y).item()
    return total / (len(data) - 1)


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    train_ids, val_ids = corpus(cfg)
    train_data, val_data = batchify(train_ids, cfg.batch_size), batchify(val_ids, cfg.batch_size)
    model = RNNModel(cfg.ntokens, cfg.emsize, cfg.nhid, cfg.nlayers, cfg.dropout, cfg.tied)
    criterion = nn.NLLLoss()
    lr = cfg.lr * cfg.lr_scale
    opt = torch.optim.SGD(model.parameters(), lr=lr) if cfg.optimizer == "sgd" else None
    observe = attach(model, cfg.run, **cfg.watch)
    losses, val_losses = [], []
    best_val_loss = math.inf
    try:
        for _epoch in range(cfg.epochs):
            model.train()
            hidden = model.init_hidden(cfg.batch_size)
            for i in range(0, train_data.size(0) - 1, cfg.bptt):
                data, targets = get_batch(train_data, i, cfg.bptt)
                # Starting each batch, we detach the hidden state from how it was previously produced.
                hidden = repackage_hidden(hidden)
                model.zero_grad()
                output, hidden = model(data, hidden)
                loss = criterion(output, targets)
                loss.backward()
                observe(loss=loss)
                # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
                if opt is not None:
                    for group in opt.param_groups:
                        group["lr"] = lr
                    opt.step()
                else:
                    for p in model.parameters():
                        p.data.add_(p.grad, alpha=-lr)
                losses.append(loss.item())
            val_loss = evaluate(model, val_data, cfg, criterion)
            val_losses.append(val_loss)
            if val_loss < best_val_loss:
                best_val_loss = val_loss
            else:  # anneal the learning rate if no improvement has been seen on the validation set
                lr /= 4.0
    finally:
        detach(model, cfg.run)
    return Result(losses, cfg.run, {"val_losses": val_losses, "model": model})
