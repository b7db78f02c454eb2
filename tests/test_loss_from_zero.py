"""A loss that was exactly 0 is no scale to spike from (issue 34): a hinge loss at exactly 0 for 30 steps
that one sample lifts to 6.25e-05 is healthy (it was "6.25e+07 std above its recent median 0"); a jump back
to half its first level, and a spike of a signed loss with a spread, are still found."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import nn

import gradwatch as gw

STEPS, LIFTED = 60, 45


def svm(run: Path, lift: float) -> pd.DataFrame:
    """A linear SVM on separable points, trained by hinge loss until every margin is past 1 (loss exactly
    0); at step ``LIFTED`` one of the 64 points sits inside the margin by ``lift`` x 64 (a batch loss of
    ``lift``)."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    gw.watch(model, run=run, overwrite=True, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.cat([torch.ones(32), -torch.ones(32)])
    x = torch.randn(64, 2) * 0.3 + y[:, None] * 2.0
    losses = []
    for step in range(STEPS):
        batch = x.clone()
        if step == LIFTED:
            with torch.no_grad():  # the point on the positive side where w.x + b = 1 - 64 * lift
                w, b = model.weight[0], model.bias[0]
                batch[0] = w * (1 - 64 * lift - b) / w.dot(w)
        opt.zero_grad()
        loss = torch.clamp(1 - y * model(batch).squeeze(1), min=0).mean()
        loss.backward()
        gw.watcher(model).observe(loss=loss.detach())  # before the step: zero_gradient knows the loss was 0
        opt.step()
        losses.append(float(loss.detach()))
    gw.unwatch(model)
    assert all(v == 0.0 for v in losses[LIFTED - 30:LIFTED])  # exactly 0 for (at least) 30 steps
    assert losses[0] > 0.1 and abs(losses[LIFTED] - lift) < 0.05 * lift
    with gw.open_run(run) as opened:
        assert opened.status == "finished" and opened.steps == STEPS
        return opened.findings()


def test_a_hinge_loss_lifted_off_exactly_zero_is_healthy(tmp_path: Path) -> None:
    findings = svm(tmp_path / "r", lift=6.25e-05)
    assert findings[findings.severity != "info"].empty, findings[["step", "kind", "message"]].to_dict("records")


def test_a_hinge_loss_back_to_half_its_start_is_a_spike(tmp_path: Path) -> None:
    findings = svm(tmp_path / "r", lift=0.5)
    spikes = findings[findings.kind == "loss_spike"]
    assert list(spikes.step) == [LIFTED]
    message = spikes.iloc[0].message
    assert "std" not in message and "above its recent losses, all 0" in message, message


def test_a_signed_loss_with_a_spread_still_spikes(tmp_path: Path) -> None:
    """A negative loss (an ELBO-like objective around -2 with batch noise) that jumps to +3 at one step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    gw.watch(model, run=tmp_path / "r", overwrite=True, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(50):
        x = torch.randn(32, 4)
        loss = model(x).pow(2).mean() - 2.0 + (5.0 if step == 40 else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        gw.watcher(model).observe(loss=loss.detach())
    gw.unwatch(model)
    with gw.open_run(tmp_path / "r") as run:
        found = run.findings()
    spikes = found[found.kind == "loss_spike"]
    assert list(spikes.step) == [40] and "std above its recent median" in spikes.iloc[0].message
