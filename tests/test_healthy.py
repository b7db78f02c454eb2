"""Healthy training of ordinary models gives no warning and no error with the default rules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw

pytestmark = pytest.mark.slow  # the model zoo trained for hundreds of steps

STEPS = 150


def cnn() -> tuple[nn.Module, Callable[[int], tuple[Any, torch.Tensor]], Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 4))
    protos = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(99))

    def batch(step: int) -> tuple[Any, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        y = torch.randint(0, 4, (32,), generator=gen)
        return protos[y] + 0.5 * torch.randn(32, 3, 16, 16, generator=gen), y

    return model, batch, nn.functional.cross_entropy


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0][:, -1])


def lstm() -> tuple[nn.Module, Callable[[int], tuple[Any, torch.Tensor]], Callable[..., torch.Tensor]]:
    def batch(step: int) -> tuple[Any, torch.Tensor]:
        x = torch.randint(0, 50, (32, 20), generator=torch.Generator().manual_seed(step))
        return x, (x[:, -3:] < 25).sum(1).ge(2).long()

    return Lstm(), batch, nn.functional.cross_entropy


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def transformer() -> tuple[nn.Module, Callable[[int], tuple[Any, torch.Tensor]], Callable[..., torch.Tensor]]:
    def batch(step: int) -> tuple[Any, torch.Tensor]:
        x = torch.randint(0, 40, (16, 24), generator=torch.Generator().manual_seed(step))
        return x, x  # copy task

    return Encoder(), batch, lambda out, y: nn.functional.cross_entropy(out.reshape(-1, 40), y.reshape(-1))


def gpt2() -> tuple[nn.Module, Callable[[int], tuple[Any, torch.Tensor]], Callable[..., torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)

    def batch(step: int) -> tuple[Any, torch.Tensor]:
        start = torch.randint(0, 64, (8, 1), generator=torch.Generator().manual_seed(step))
        x = (start + torch.arange(32) * 3) % 64  # arithmetic sequences: learnable
        return x, x

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, 64), y[:, 1:].reshape(-1))

    return model, batch, loss


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 20))


CASES = {
    "cnn-bn-sgd": (cnn, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), None),
    "lstm-adam": (lstm, lambda p: torch.optim.Adam(p, lr=3e-3), None),
    "transformer-adamw-warmup": (transformer, lambda p: torch.optim.AdamW(p, lr=1e-3), warmup),
    "gpt2-adamw-warmup": (gpt2, lambda p: torch.optim.AdamW(p, lr=1e-3), warmup),
}


@pytest.mark.parametrize("name", list(CASES))
def test_healthy_model_zoo_is_quiet(name: str, run_dir: Path) -> None:
    make, make_opt, make_sched = CASES[name]
    torch.manual_seed(0)
    model, batch, loss_fn = make()
    gw.watch(model, run=run_dir, console=False)
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    gw.unwatch(model)
    assert sum(losses[-20:]) < 0.9 * sum(losses[:20]), "the model learns"
    found = gw.open_run(run_dir).findings()
    loud = found[found.severity != "info"]
    assert loud.empty, list(zip(loud.kind, loud.step, loud.layer, loud.message))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_trained_wholly_in_low_precision_is_quiet(dtype: torch.dtype, run_dir: Path) -> None:
    """``model.to(torch.bfloat16)`` and plain Adam, no autocast: updates below half a weight's last digit
    round to exactly 0 (a LayerNorm gain of 1.0 at lr 1e-3), which is not a learning rate of 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4)).to(dtype)
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)  # fp16's usual eps: 1e-8 is 0 in it
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(4096, 32, generator=gen)
    y_all = x_all[:, :4].argmax(1)
    losses = []
    for _ in range(STEPS):
        i = torch.randint(0, 4096, (128,), generator=gen)
        loss = nn.functional.cross_entropy(model(x_all[i].to(dtype)).float(), y_all[i])
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(float(loss.detach()))
    gw.unwatch(model)
    assert sum(losses[-20:]) < 0.7 * sum(losses[:20]), "the model learns"
    from gradwatch.cli.rejudge import rejudge

    for found in (gw.open_run(run_dir).findings(), rejudge(gw.open_run(run_dir))):  # live, and offline from the store
        loud = found[found.severity != "info"]
        assert loud.empty, list(zip(loud.kind, loud.step, loud.layer, loud.message))
