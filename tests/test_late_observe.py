"""A loss observed after ``optimizer.step()`` (or after ``backward()`` in a loop that updates by hand)
belongs to the step whose forward pass computed it, not to the next one (gradwatch.step.openstep).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw

SPIKE = 25  # the step whose targets are 50x too large: its loss spikes, its gradients explode
STEPS = 32


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    return x, x.sum(1, keepdim=True)


def _train(tmp_path: Path, placement: str) -> tuple[list[float], Path]:
    """Thirty-two steps of a small regression with the loss observed at ``placement``; the losses the loop saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / placement
    gw.watch(model, run=run, console=False)
    watcher = gw.watcher(model)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        loss = ((model(x) - y * (50.0 if step == SPIKE else 1.0)) ** 2).mean()
        losses.append(loss.item())
        if placement == "by_hand":  # no optimizer: the step's moment is the end of backward
            model.zero_grad()
            loss.backward()
            watcher.observe(loss=loss)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            continue
        opt.zero_grad()
        loss.backward()
        if placement == "before_step":
            watcher.observe(loss=loss)
        opt.step()
        if placement == "after_step":
            watcher.observe(loss=loss)
        elif placement == "after_step_number":
            watcher.observe(loss=loss.item())
    gw.unwatch(model)
    return losses, run


@pytest.mark.parametrize("placement", ["before_step", "after_step", "after_step_number", "by_hand"])
def test_the_loss_is_recorded_and_judged_at_the_step_that_computed_it(tmp_path: Path, placement: str) -> None:
    losses, path = _train(tmp_path, placement)
    with gw.open_run(path) as run:
        recorded = run.scalars(["loss"])["loss"]
        findings = run.findings()
        assert run.steps == STEPS
    # every step has its own loss, the last one included (observed after the last step, then closed)
    assert list(recorded.index) == list(range(STEPS))
    assert recorded.to_numpy() == pytest.approx(losses, rel=1e-6)
    spikes = findings[findings["kind"] == "loss_spike"]
    assert list(spikes["step"]) == [SPIKE], findings[["step", "kind", "message"]]
    assert list(findings[findings["kind"] == "exploding"]["step"]) == [SPIKE]


def test_accumulated_micro_batches_average_with_the_last_one_observed_after_the_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw.watch(model, run=tmp_path / "run", console=False)
    gen = torch.Generator().manual_seed(1)
    expected = []
    for _ in range(6):
        micro = []
        for k in range(4):
            x = torch.randn(16, 8, generator=gen)
            loss = model(x).pow(2).mean()
            (loss / 4).backward()
            micro.append(loss.item())
            if k == 3:
                opt.step()
                opt.zero_grad()
            gw.watcher(model).observe(loss=loss)  # the fourth after the step
        expected.append(sum(micro) / 4)
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.scalars(["loss"])["loss"].to_numpy() == pytest.approx(expected, rel=1e-6)


def test_a_learning_rate_read_after_the_scheduler_steps_is_still_the_next_steps(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    gw.watch(model, run=tmp_path / "run", console=False)
    used = []
    for _ in range(5):
        used.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
        gw.watcher(model).observe(my_lr=sched.get_last_lr()[0])  # a plain number: for the step that follows
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        seen = run.scalars(["my_lr", "lr"])
    assert seen["lr"].to_numpy() == pytest.approx(used)
    assert list(seen["my_lr"].dropna().index) == [1, 2, 3, 4]
    assert seen["my_lr"].dropna().to_numpy() == pytest.approx(used[1:])


def test_a_late_loss_is_on_disk_after_a_flush_and_a_late_nan_loss_is_its_steps_error(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gw.watch(model, run=tmp_path / "run", console=False)
    watcher = gw.watcher(model)
    for step in range(8):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        watcher.observe(loss=float("nan") if step == 6 else loss)  # finite gradients, a NaN loss
        if step == 4:
            watcher.flush()
            with gw.open_run(tmp_path / "run") as run:
                assert list(run.scalars(["loss"]).index) == [0, 1, 2, 3, 4]
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        findings = run.findings()
        loss = run.scalars(["loss"])["loss"]
    assert math.isnan(loss[6])
    (error,) = findings[findings["severity"] == "error"].itertuples()
    assert (error.kind, error.step) == ("nonfinite", 6)
    assert "the loss is nan" in error.message
