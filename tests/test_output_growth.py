"""Detector ``output_growth`` (issue 36, Rybakov et al. 2024): linear layers' outputs growing step after step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw
from gradwatch.detectors.output_growth import OutputGrowth
from gradwatch.store.records import LAYER, Layout, StepRecord

LAYOUT = Layout(version=1, layers=("blocks.0.attn.c_attn", "blocks.0.act", "blocks.0.mlp.c_proj", "lm_head"),
                layer_types=("Linear", "GELU", "Linear", "Linear"), layer_numel=(4, 0, 4, 4),
                params=("blocks.0.attn.c_attn.weight", "blocks.0.mlp.c_proj.weight", "lm_head.weight"),
                param_numel=(4, 4, 4), owners=((0, 0), (2, 1), (3, 2)), leaves=(0, 1, 2, 3),
                trainable=(True, True, True))


def record(step: int, norms: list[float], *, loss: float = 1.0, layout: Layout = LAYOUT) -> StepRecord:
    norms = [*norms, 30.0 * 1.5 ** (step / 10)]  # the output layer's logits grow as it grows confident: not judged
    return StepRecord(step=step, time=0.0, layout=layout, scalars={"loss": loss, "lr": 1e-2},
                      vectors={(LAYER, "act_norm"): np.asarray(norms, dtype=np.float32)}, sampled=True)


def judge(detector: OutputGrowth, series: list[float], *, every: int = 10, losses: list[float] | None = None,
          start: int = 0) -> list:
    """Feed one output-norm series (the second Linear's; the first stays flat) on sampled steps."""
    found = []
    for k, value in enumerate(series):
        step = start + k * every
        loss = 1.0 if losses is None else losses[k]
        rec = record(step, [100.0 * (1 + 0.01 * (k % 2)), 1.0, value], loss=loss)
        detector.causes.loss_of(rec)
        found += detector.check(rec)
    return found


def test_sustained_compounding_growth_is_found_once() -> None:
    series = [50.0 * (1 + 0.02 * (k % 3)) for k in range(8)] + [50.0 * 1.45 ** k for k in range(1, 14)]
    found = judge(OutputGrowth(), series)
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.severity, f.layer) == ("output_growth", "warning", "blocks.0.mlp.c_proj")
    assert f.data["layers"] == ["blocks.0.mlp.c_proj"] and f.data["count"] == 1
    assert f.data["growth"] >= 4.0 and f.data["to"] > f.data["from"]
    assert f.data["per_step"] == pytest.approx(1.45 ** 0.1, rel=0.05)
    assert "Rybakov" in f.message and "per 10 steps" in f.message


def test_growth_that_saturates_is_quiet() -> None:
    """A small initialisation's output grows 500x, fast at first then slower, and levels off."""
    series = [2.0 + 1000.0 * (1 - math.exp(-k / 4)) for k in range(40)]
    assert judge(OutputGrowth(), series) == []
    power = [10.0 * (k + 1) ** 2 for k in range(40)]  # a power of the step: slows down in log
    assert judge(OutputGrowth(), power) == []


def test_growth_under_a_rising_learning_rate_is_the_warmups() -> None:
    detector = OutputGrowth()
    found = []
    for k in range(20):
        rec = record(k * 10, [100.0, 1.0, 50.0 * 1.45 ** k])
        rec.scalars["lr"] = 1e-4 * (k + 1)  # a linear warmup over the whole window
        found += detector.check(rec)
    assert found == []


def test_unmeasured_steps_are_skipped_and_a_fall_ends_the_rise() -> None:
    series = [50.0 * 1.45 ** k for k in range(20)]
    with_gaps = []
    for value in series:
        with_gaps += [value, math.nan]  # the layer not called on every other sampled step
    assert len(judge(OutputGrowth(), with_gaps, every=5)) == 1
    broken = [v * (0.5 if k % 4 == 3 else 1.0) for k, v in enumerate(series)]  # it falls every 4th measurement
    assert judge(OutputGrowth(), broken) == []


def test_renewed_weights_restart_the_history() -> None:
    detector = OutputGrowth()
    series = [50.0 * 1.45 ** k for k in range(12)]
    judge(detector, series[:8])
    renewed = Layout(**{**LAYOUT.__dict__, "version": 2, "renewed": (2,)})
    for k, value in enumerate(series[8:], start=8):  # without the restart these would complete the window
        assert detector.check(record(k * 10, [100.0, 1.0, value], layout=renewed)) == []


def test_the_loss_that_follows_makes_it_an_error_once() -> None:
    series = [50.0 * 1.45 ** k for k in range(30)]
    losses = [2.0 - 0.01 * k for k in range(12)] + [2.0 * 1.4 ** k for k in range(18)]
    found = judge(OutputGrowth(), series, every=1, losses=losses)
    severities = [f.severity for f in found]
    assert severities == ["warning", "error"]
    assert found[1].data["named_at"] == found[0].step and found[1].step > found[0].step


# ----------------------------------------------------------------------------------------- a real run
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.c_attn(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(d, 4 * d))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small pre-LN decoder with nanoGPT's module names and GPT-2's N(0, 0.02) initialisation."""

    def __init__(self, vocab: int = 32, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def train(run: Path, *, lr: float, warmup: int, steps: int, vocab: int = 32, seq: int = 32) -> list[float]:
    """Random tokens whose second half repeats the first; next-token cross-entropy; AdamW."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, seq=seq)
    gw.watch(model, run=run, rules=None, console=False, sample_every=5)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        half = torch.randint(0, vocab, (16, seq // 2), generator=gen)
        tokens = torch.cat([half, half, half[:, :1]], 1)
        loss = F.cross_entropy(model(tokens[:, :seq]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss.item())
        opt.step()
        losses.append(loss.item())
    gw.unwatch(model)
    return losses


def check(run: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run), "--format", "json", "--fail-on",
                           "warning"], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_the_healthy_twin_is_quiet(tmp_path: Path) -> None:
    """lr 1e-3 with a warmup: the outputs grow from their small initialisation, then level off."""
    losses = train(tmp_path / "run", lr=1e-3, warmup=20, steps=200)
    assert min(losses) < 0.7 * losses[0]  # it learns
    out = check(tmp_path / "run")
    assert [f for f in out["findings"] if f["kind"] == "output_growth"] == []
    assert out["verdict"] == "pass", out["findings"]
