"""The report and the dashboard mark and scale alike: the gradient-flow bars show the state of the step
shown (not a finding from long before), and the loss axis is log or linear by one rule in both."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.dashboards import data
from gradwatch.report import figures
from gradwatch.report.data import collect
from gradwatch.report.marks import flow_marks, loss_log


def frame(*rows: tuple[str | None, int, str, dict]) -> pd.DataFrame:  # type: ignore[type-arg]
    return pd.DataFrame(rows, columns=["layer", "step", "severity", "data"])


def test_a_finding_long_before_the_step_shown_is_history() -> None:
    found = frame(("head", 180, "warning", {}), ("body.0", 250, "error", {"last_step": 299}),
                  ("body.2", 290, "warning", {}), ("body.2", 299, "error", {}), (None, 299, "warning", {}),
                  ("body.4", 299, "info", {}))
    now, earlier = flow_marks(found, 299, ["features", "body.0", "body.2", "body.4", "head"])
    assert now == {"body.0": "error", "body.2": "error"}  # a repeat folded up to 299 holds; the worst severity
    assert earlier == {"head": 180}  # the explosion at 180 is no longer the state at 299
    now, earlier = flow_marks(found, 180, ["head", "body.0"])
    assert now == {"head": "warning"} and earlier == {}
    assert flow_marks(found, 299, ["other"]) == ({}, {})


@pytest.mark.parametrize(("values", "log"), [
    ([2.3, 1.0, 0.1, 0.002], True), ([2.3, 1.0, 0.5], False), ([2.0, 0.0, 1e-5], False),
    ([-3.0, -100.0, 5.0], False), ([float("nan"), 1.0, 1e-4], True), ([], False),
])
def test_loss_log_rule(values: list[float], log: bool) -> None:
    assert loss_log(values) is log


@pytest.fixture(scope="module")
def spiky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose loss falls by decades, with a gradient explosion at step 100 and none after."""
    run_dir = tmp_path_factory.mktemp("marks") / "spiky"
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)), run=run_dir, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 4), torch.full((64, 1), 3.0)  # an easy target: the loss falls by decades
    for step in range(120):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (loss * (1e6 if step == 100 else 1.0)).backward()  # the gradient explodes at step 100, and only there
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return run_dir


def test_dashboard_flow_marks_the_step_shown(spiky: Path) -> None:
    run = gw.open_run(spiky)
    found = run.findings()
    layered = found[found["layer"].notna() & found["severity"].isin(["warning", "error"])]
    assert len(layered), found  # the explosion at step 100 names a layer
    latest = data.flow(run)
    assert latest["step"] == 119 and latest["flagged"] == {}, "nothing holds at the latest step"
    assert set(latest["earlier"]) == set(layered["layer"]) & set(latest["layers"])
    at = data.flow(run, step=100)
    assert at["flagged"] and set(at["flagged"]) <= set(layered["layer"]) and at["earlier"] == {}


def test_loss_axis_is_the_same_in_the_report_and_the_dashboard(spiky: Path) -> None:
    run = gw.open_run(spiky)
    curves = data.curves(run, data.Curves())
    report = figures.timeline(collect(run))
    assert report is not None
    loss_axis = next(ax for name, ax in report.layout.to_plotly_json().items()
                     if name.startswith("yaxis") and ax.get("title", {}).get("text") == "loss")
    assert (loss_axis.get("type") == "log") == curves["curves"]["loss"]["log"]
    assert curves["curves"]["loss"]["log"] is loss_log(run.series("loss")[1]) is True


def test_dashboard_flow_names_the_layers_whose_gradient_is_nan_at_the_step_shown(tmp_path: Path) -> None:
    """A NaN step has no norms to draw: the flow says which layers' gradients were NaN/Inf there."""
    model = gw.watch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), run=tmp_path / "nan",
                     console=False, rules=[gw.Rule(when="nonfinite", do="halt")])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(gw.TrainingHalted):
        for step in range(10):
            x = torch.randn(8, 3)
            if step == 4:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    run = gw.open_run(tmp_path / "nan")
    at_nan = data.flow(run)
    assert at_nan["step"] == 4 and at_nan["nonfinite"] == ["0", "2"]
    assert all(v is None for v in at_nan["values"]), "no finite norm to draw"
    assert data.flow(run, step=3)["nonfinite"] == []
