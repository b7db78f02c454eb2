"""One cause, one finding (issue 34): layers that a detector flags alike at one step — the early layers of a
deep stack whose param group's learning rate is far too low, every layer of a model whose learning rate is
far too high — are one ``update_ratio`` finding naming the layers it covers, not one finding per layer."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import nn

import gradwatch as gw
from gradwatch.wording import layer

EARLY = [str(i) for i in range(0, 20, 2)]  # the ten Linear layers of the slow param group


def deep_stack(run: Path, early_lr: float, late_lr: float, steps: int = 40) -> pd.DataFrame:
    """Twelve Linear+Tanh blocks and a head; the first ten Linears in a param group of their own."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(32, 32), nn.Tanh())], nn.Linear(32, 1))
    gw.watch(model, run=run, overwrite=True, sample_every=5, console=False, rules=None)
    blocks = list(model)
    opt = torch.optim.SGD([{"params": [p for m in blocks[:20] for p in m.parameters()], "lr": early_lr},
                           {"params": [p for m in blocks[20:] for p in m.parameters()], "lr": late_lr}])
    x, y = torch.randn(128, 32), torch.randn(128, 1)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        gw.watcher(model).observe(loss=loss.detach())
    gw.unwatch(model)
    with gw.open_run(run) as opened:
        assert opened.status == "finished"
        return opened.findings()


def covered(row: pd.Series) -> list[str]:
    return list(row.data.get("layers") or [row.layer])


def test_early_layers_that_barely_learn_are_one_finding_per_step(tmp_path: Path) -> None:
    findings = deep_stack(tmp_path / "r", early_lr=1e-5, late_lr=0.05)
    ratios = findings[findings.kind == "update_ratio"]
    assert len(ratios) > 0
    assert not ratios.step.duplicated().any(), ratios[["step", "layer", "message"]].to_dict("records")
    widest = max((row for _, row in ratios.iterrows()), key=lambda row: len(covered(row)))
    layers = covered(widest)
    assert len(layers) >= 5 and set(layers) <= set(EARLY)
    assert widest.layer == layers[0] and widest.data["count"] == len(layers)
    assert len(widest.data["ratios"]) == len(layers)
    assert all(0 < r < 1e-8 for r in widest.data["ratios"])
    assert widest.message.startswith(f"updates of {len(layers)} layers ({layer(layers[0])}, ")
    assert "Linear" in widest.message and "they do not learn" in widest.message
    every = {name for _, row in ratios.iterrows() for name in covered(row)}
    assert every <= set(EARLY) and len(every) >= 8  # the slow group's layers, never the others


def test_a_too_large_update_on_every_layer_is_one_finding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    gw.watch(model, run=tmp_path / "r", overwrite=True, console=False, rules=None, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=20.0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(6):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "r") as run:
        found = run.findings()
    ratios = found[found.kind == "update_ratio"]
    assert len(ratios) > 0 and not ratios.step.duplicated().any()
    first = ratios.iloc[0]
    assert first.step == 1 and all(r > 1.0 for r in first.data.get("ratios") or [2.0])
    assert "too large" in first.message and set(covered(first)) <= {"0", "2", "4"}


def test_a_healthy_stack_has_nothing_to_group(tmp_path: Path) -> None:
    findings = deep_stack(tmp_path / "r", early_lr=0.05, late_lr=0.05, steps=20)
    assert findings[findings.kind == "update_ratio"].empty  # a healthy stack: nothing to group
