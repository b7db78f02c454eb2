"""``optimizer.step(closure)``: the gradients exist only once step() has run the closure, so the
step is measured, judged and acted on after the closure's first evaluation, before the update;
L-BFGS's further evaluations in one step are not iterations of their own."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch as gw


def regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(64, 4)
    return model, x, x @ torch.randn(4, 1) + 0.1


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4),
}


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int, *,
          keyword: bool = False, nan_at: int | None = None) -> dict[str, list[Any]]:
    """A closure loop; returns what the first evaluation of each step saw (gradient norm, loss,
    per-parameter gradients and weights) and the weights after each step."""
    seen: dict[str, list[Any]] = {"norm": [], "loss": [], "before": [], "after": [], "evaluations": []}
    for step in range(steps):
        calls = 0

        def closure(step: int = step) -> torch.Tensor:
            nonlocal calls
            calls += 1
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if calls == 1:
                if step == nan_at:
                    next(model.parameters()).grad[0, 0] = math.nan
                grads = [p.grad for p in model.parameters()]
                seen["norm"].append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
                seen["loss"].append(float(loss.detach()))
                seen["before"].append([p.detach().clone() for p in model.parameters()])
            return loss

        opt.step(closure=closure) if keyword else opt.step(closure)
        seen["evaluations"].append(calls)
        seen["after"].append([p.detach().clone() for p in model.parameters()])
    return seen


@pytest.mark.parametrize(("name", "keyword"), [("sgd", False), ("sgd", True), ("adam", False), ("lbfgs", False)])
def test_each_step_is_measured_from_its_closure_first_evaluation(run_dir: Path, name: str, keyword: bool) -> None:
    model, x, y = regression()
    opt = OPTIMIZERS[name](model.parameters())
    gw.watch(model, run=run_dir, console=False, sample_every=2)
    seen = train(model, opt, x, y, steps=8, keyword=keyword)
    gw.unwatch(model)
    if name == "lbfgs":
        assert max(seen["evaluations"]) > 1  # the line search evaluated the closure again
    with gw.open_run(run_dir) as run:
        assert run.steps == 8 and run.status == "finished"
        assert not run.step_info()["skipped"].any()  # further evaluations are no dropped iterations
        scalars = run.scalars()
        np.testing.assert_allclose(scalars["grad_norm"], seen["norm"], rtol=1e-5)
        np.testing.assert_allclose(scalars["loss"], seen["loss"], rtol=1e-6)  # the closure's loss, observed
        ratio = run.matrix("update_ratio")  # sampled steps: the whole step's update of each layer
        assert list(ratio.index) == [0, 2, 4, 6]
        assert run.findings().empty
    for step in ratio.index:
        before, after = seen["before"][step], seen["after"][step]
        expected = [math.sqrt(float(((b - a) ** 2).sum() + ((bb - ab) ** 2).sum()))
                    / math.sqrt(float((b**2).sum() + (bb**2).sum()))
                    for b, a, bb, ab in [(before[0], after[0], before[1], after[1]),
                                         (before[2], after[2], before[3], after[3])]]
        np.testing.assert_allclose(ratio.loc[step, ["0", "2"]].to_numpy(dtype=float), expected, rtol=1e-4)


@pytest.mark.parametrize("name", ["sgd", "lbfgs"])
def test_a_nan_in_the_closure_is_skipped_before_the_update(run_dir: Path, name: str) -> None:
    model, x, y = regression()
    opt = OPTIMIZERS[name](model.parameters())
    gw.watch(model, run=run_dir, console=False)
    seen = train(model, opt, x, y, steps=6, nan_at=3)
    gw.unwatch(model)
    for b, a in zip(seen["before"][3], seen["after"][3]):
        assert torch.equal(b, a)  # the NaN step changed nothing
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not torch.equal(seen["after"][5][0], seen["after"][3][0])  # and training went on
    with gw.open_run(run_dir) as run:
        assert [(r.step, r.kind, r.action) for r in run.findings().itertuples()] == [(3, "nonfinite", "skip")]


def test_a_halt_raises_from_step_before_the_update(run_dir: Path) -> None:
    model, x, y = regression()
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    gw.watch(model, run=run_dir, console=False, rules=[gw.Rule(when="nonfinite", do="halt")])
    with pytest.raises(gw.TrainingHalted) as halted:
        train(model, opt, x, y, steps=6, nan_at=2)
    assert halted.value.step == 2
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    with gw.open_run(run_dir) as run:
        assert run.status == "halted"
