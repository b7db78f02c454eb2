"""Detector ``adam_epsilon``: gradients at the scale of Adam's eps shrink every update far below the learning rate."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradwatch as gw
from gradwatch.step.optimizers import Optimizers
from gradwatch.store.records import ADAM_EPS


def train(path: Path, make_opt: Any, *, scale: float = 4e-4, steps: int = 45) -> list[float]:
    """A small MLP regression whose backward runs on ``loss * scale`` (gradient RMS ~1e-5 at 4e-4); the losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(256, 16)
    y = torch.sin(2 * x[:, :1]) + x[:, 1:2]
    gw.watch(model, run=path, console=False)
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        (loss * scale).backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
    gw.unwatch(model)
    return losses


def check(path: Path) -> tuple[int, dict[str, Any]]:
    """``python -m gradwatch check RUN --format json --fail-on warning``, as CI runs it: exit code and report."""
    done = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(path), "--format", "json",
                           "--fail-on", "warning"], capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_eps_above_the_gradients_is_named_then_the_stalled_loss_is_an_error(tmp_path: Path) -> None:
    """AdamW(eps=1e-3) on gradients of RMS ~1e-5: every update ~1% of lr; a warning, then an error as the loss
    stalls."""
    run = tmp_path / "r"
    losses = train(run, lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-3))
    assert losses[-1] > 0.95 * losses[0], "the planted run barely learns"
    code, report = check(run)
    assert code == 1 and report["verdict"] == "fail"
    assert [(f["kind"], f["severity"]) for f in report["findings"]] == [("adam_epsilon", "warning"),
                                                                       ("adam_epsilon", "error")]
    warning, error = report["findings"]
    assert warning["layer"] == "2" and 10 <= warning["step"] <= 30  # the largest layer: '2' (64x64)
    assert "Adam's eps dominates the update" in warning["message"] and "eps 0.001" in warning["message"]
    assert error["layer"] == "2" and error["step"] >= warning["step"] + 20
    with gw.open_run(run) as opened:
        data = opened.findings().data.iloc[0]
    assert set(data["layers"]) == {"0", "2", "4"}
    assert 3e-6 < data["grad_rms"] < 3e-5 and data["eps"] == 1e-3
    assert 3e-3 < data["shrink"] < 3e-2 and math.isclose(data["shrink"], data["grad_rms"] / (data["grad_rms"] + 1e-3))
    assert "smaller eps" in data["hint"]


def test_the_same_run_with_a_small_eps_is_quiet_and_learns(tmp_path: Path) -> None:
    """The mitigated twin: eps 1e-10 on the same gradients (Adam is scale-free then) learns; nothing is said."""
    run = tmp_path / "r"
    losses = train(run, lambda p: torch.optim.AdamW(p, lr=1e-3, eps=1e-10))
    assert losses[-1] < 0.5 * losses[0]
    code, report = check(run)
    assert code == 0 and report["findings"] == []


def test_a_converged_run_whose_gradients_fell_below_eps_is_quiet(tmp_path: Path) -> None:
    """Gradients that fell to eps's scale because the loss did (a fit to a teacher network) are not judged.

    With eps 1e-3 (harder than the default 1e-8, which such gradients never approach), the first layer's RMS falls
    to ~1e-4 by step 200: its updates are a tenth of lr there, but the loss fell 500x.
    """
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(128, 8)
    with torch.no_grad():
        y = teacher(x)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    gw.watch(model, run=tmp_path / "r", console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    for _ in range(260):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "r") as run:
        assert run.findings().empty
        grads = run.metrics("grad_norm", layers=["0"], include_global=False)
    assert float(grads.value.iloc[-1]) / 12 < 1.1e-4, "the first layer's RMS reached eps / 9: the guard was needed"


def test_sgd_is_never_judged(tmp_path: Path) -> None:
    """SGD does not divide by sqrt(v) + eps: no eps is recorded and the tiny gradients are nobody's finding."""
    run = tmp_path / "r"
    train(run, lambda p: torch.optim.SGD(p, lr=1e-3), steps=25)
    with gw.open_run(run) as opened:
        assert "adam_epsilon" not in set(opened.findings().kind)  # learning_rate says the updates are too small
        assert ADAM_EPS not in set(opened.metrics(per_parameter=True, include_global=False).metric)


def test_which_optimizers_divide_by_eps() -> None:
    """The Adam family and RMSprop record their groups' eps; SGD, Adagrad, centered RMSprop, LAMB-type and a
    tensor eps do not."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))

    class Lamb(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 1e-3, "eps": 1e-6, "betas": (0.9, 0.999)})

    class Custom(Lamb):  # any other optimizer whose groups hold eps and betas
        pass

    def recorded(opt: torch.optim.Optimizer) -> list[float]:
        optimizers = Optimizers([a, b], grown=lambda: None, named=lambda names: None)
        optimizers.entry(opt)
        eps = optimizers.adam_eps(2)
        return [] if eps is None else [float(str(v)) if not math.isnan(v) else -1.0 for v in eps]  # float32's

    two = [{"params": [a], "eps": 1e-6}, {"params": [b]}]
    assert recorded(torch.optim.AdamW(two, eps=1e-3)) == [1e-6, 1e-3]
    for cls in (torch.optim.Adam, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax, torch.optim.RMSprop):
        assert recorded(cls([a], eps=1e-4)) == [1e-4, -1.0], cls.__name__
    assert recorded(Custom([a, b])) == [1e-6, 1e-6]
    assert recorded(Lamb([a, b])) == []
    assert recorded(torch.optim.SGD([a, b], lr=0.1)) == []
    assert recorded(torch.optim.Adagrad([a, b])) == []
    assert recorded(torch.optim.RMSprop([a, b], centered=True)) == []
    tensor_eps = torch.optim.Adam([a, b])
    tensor_eps.param_groups[0]["eps"] = torch.tensor(1e-8)
    assert recorded(tensor_eps) == []
