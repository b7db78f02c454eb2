"""A step that is not applied leaves the model as it was before its forward calls, buffers included.

A NaN batch goes through BatchNorm's forward before any gradient exists: its running statistics
are NaN by the time the step is skipped. The skip (and a halt, and a rollback) puts them back.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradwatch as gw


def bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 1, 8, 8, generator=gen)
    y = (torch.rand(256, generator=gen) > 0.5).long()
    return x + (2.0 * y - 1.0)[:, None, None, None], y


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def batches(x: torch.Tensor, y: torch.Tensor, steps: int, nan_at: int | None) -> Batches:
    out = []
    for s in range(steps):
        idx = torch.arange(s * 32, s * 32 + 32) % len(x)
        xb = x[idx].clone()
        if s == nan_at:
            xb[3] = float("nan")
        out.append((xb, y[idx]))
    return out


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, bool]:
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    return float((out.argmax(1) == y).float().mean()), bool(out.isfinite().all())


def train(model: nn.Module, data: Batches, *, watch_dir: Path | None = None,
          rules: object = "default", at: int | None = None) -> dict[str, torch.Tensor] | None:
    """Train on ``data``; returns the buffers before step ``at``'s forward, checked unchanged after its step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if watch_dir is not None:
        gw.watch(model, run=watch_dir, rules=rules, console=False)
    before = None
    for step, (xb, yb) in enumerate(data):
        if step == at:
            before = buffers(model)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step == at:
            assert before is not None
            after = buffers(model)
            for name, value in before.items():
                assert torch.equal(after[name], value), f"{name} changed by the skipped step"
    if watch_dir is not None:
        gw.unwatch(model)
    return before


def test_a_skipped_nan_batch_leaves_batchnorm_statistics_as_they_were(tmp_path: Path) -> None:
    x, y = data()
    clean = bn_cnn()
    train(clean, [b for s, b in enumerate(batches(x, y, 24, None)) if s != 9])  # never saw batch 9
    model = bn_cnn()
    train(model, batches(x, y, 24, nan_at=9), watch_dir=tmp_path / "run", at=9)  # default rules: skip

    acc, finite = accuracy(model, x, y)
    clean_acc, _ = accuracy(clean, x, y)
    assert finite and acc == clean_acc and acc > 0.9
    for name, value in buffers(clean).items():  # exactly the run that never saw the bad batch
        assert torch.equal(dict(model.named_buffers())[name], value), name
    for name, p in clean.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p), name

    run = gw.open_run(tmp_path / "run")
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.step) == [9] and list(found.action) == ["skip"]
    outcome = found.iloc[0].data["outcome"]
    assert outcome["skipped"] and outcome["buffers_restored"] == 6 and "buffers_changed" not in outcome


class RunningMean(nn.Module):
    """A running average of the input kept as a buffer, and a count that is not saved with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("avg", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("mask", torch.ones(64, 64), persistent=False)  # a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg.mul_(0.9).add_(0.1 * x.mean(0))
        self.calls += 1
        return self.lin(x * self.mask[0, :4])


@pytest.mark.parametrize("rules", ["default", [gw.Rule(when="nonfinite", do="halt")]], ids=["skip", "halt"])
def test_running_averages_and_any_buffer_are_put_back(tmp_path: Path, rules: object) -> None:
    torch.manual_seed(0)
    model = RunningMean()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw.watch(model, run=tmp_path / "run", rules=rules, console=False)
    for step in range(6):
        xb = torch.randn(16, 4)
        if step == 4:
            xb[0, 0] = float("nan")
            before = buffers(model)
        opt.zero_grad()
        model(xb).pow(2).mean().backward()
        if step == 4 and rules != "default":
            with pytest.raises(gw.TrainingHalted):
                opt.step()
            break
        opt.step()
        if step == 4:
            after = buffers(model)
            assert before.keys() == after.keys() == {"avg", "calls", "mask"}
            for name in before:
                assert torch.equal(after[name], before[name]), name
    else:
        gw.unwatch(model)
        assert int(model.calls) == 5 and model.avg.isfinite().all()
        return
    after = buffers(model)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    assert gw.open_run(tmp_path / "run").status == "halted"


def test_a_buffer_first_changed_by_the_skipped_step_is_named(tmp_path: Path) -> None:
    """A non-persistent buffer that never changed before the bad step has no copy: the finding says so."""

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.register_buffer("seen", torch.zeros(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not x.isfinite().all():
                self.seen.add_(x.sum(0))
            return self.lin(x)

    torch.manual_seed(0)
    model = Late()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw.watch(model, run=tmp_path / "run", console=False)
    for step in range(5):
        xb = torch.randn(8, 4)
        if step == 3:
            xb[0, 0] = float("inf")
        opt.zero_grad()
        model(xb).pow(2).mean().backward()
        opt.step()
    gw.unwatch(model)
    found = gw.open_run(tmp_path / "run").findings()
    assert list(found.step) == [3] and list(found.action) == ["skip"]
    assert found.iloc[0].data["outcome"]["buffers_changed"] == ["seen"]


def test_gradient_accumulation_restores_the_buffers_of_every_micro_batch(tmp_path: Path) -> None:
    x, y = data()
    model = bn_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw.watch(model, run=tmp_path / "run", console=False)
    data_ = batches(x, y, 16, nan_at=11)
    for step in range(8):
        if step == 5:
            before = buffers(model)
        opt.zero_grad()
        for xb, yb in data_[2 * step:2 * step + 2]:  # the NaN is in the second micro-batch of step 5
            F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step == 5:
            for name, value in buffers(model).items():
                assert torch.equal(value, before[name]), name
    gw.unwatch(model)
    assert accuracy(model, x, y)[1]


def test_rollback_restores_the_snapshot_s_batchnorm_statistics(tmp_path: Path) -> None:
    x, y = data()
    model = bn_cnn()
    rules = [gw.Rule(when="nonfinite", do="rollback", skip_batches=0)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gw.watch(model, run=tmp_path / "run", rules=rules, console=False, snapshot_every=4)
    kept: dict[int, dict[str, torch.Tensor]] = {}
    for step, (xb, yb) in enumerate(batches(x, y, 20, nan_at=10)):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        kept[step] = copy.deepcopy(buffers(model))  # after the step's forward: what a snapshot at it holds
        opt.step()
        if step == 10:
            restored = gw.open_run(tmp_path / "run").findings().iloc[0].data["outcome"]["restored_step"]
            for name, value in buffers(model).items():
                assert torch.equal(value, kept[restored][name]), name
    gw.unwatch(model)
    assert accuracy(model, x, y)[1]
