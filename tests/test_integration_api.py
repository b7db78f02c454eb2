"""The watcher's integration API (Watcher.integrate, gradients_ready, leave_out, latest) with plain torch.

Frameworks own their loops: Lightning steps ``optimizer.step(closure)`` (its step pre-hook runs
before the closure's backward), and neither framework may see an exception for a halt. These
tests drive the API the way the Lightning and HF integrations do, without the frameworks.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.watching.registry import check_settings


def regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    return model, x, y


def closure_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
                 poison: bool = False, signal: bool = True) -> None:
    """A Lightning-style step: forward and backward run inside ``optimizer.step(closure)``."""
    watcher = gw.watcher(model) if signal else None

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if poison:
            model[0].weight.grad[0, 0] = float("nan")
        if watcher is not None and not watcher.closed:
            watcher.observe(loss=loss.detach())
            watcher.gradients_ready(opt)
        return loss

    opt.step(closure)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               poison: bool = False) -> None:
    """An HF-Trainer-style step: backward, then ``optimizer.step()`` (its pre-hook is the step moment)."""
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if poison:
        model[0].weight.grad[0, 0] = float("nan")
    opt.step()


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for u, v in zip(a, b, strict=True):
            assert_same(u, v)
    else:
        assert a == b


def test_signalled_steps_measure_the_gradients_the_closure_computed(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)
    gw.watcher(model).integrate(on_halt=pytest.fail, signalled=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    expected = []

    def probe_norm(opt_: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        expected.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))

    handle = opt.register_step_post_hook(probe_norm)  # after the closure: the gradients of this step
    for i in range(6):
        closure_step(model, opt, x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
    handle.remove()
    latest = gw.watcher(model).latest
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 6, "one step per optimizer.step(closure), the ignored pre-hook adds none"
    _, norms = run.series("grad_norm")
    assert norms == pytest.approx(expected, rel=1e-5)
    assert run.series("loss")[1].shape == (6,) and latest["grad_norm"] == pytest.approx(expected[-1], rel=1e-5)
    assert run.findings().empty


def test_gradients_ready_needs_signalled_mode(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)
    with pytest.raises(RuntimeError, match="signalled=True"):
        gw.watcher(model).gradients_ready(torch.optim.SGD(model.parameters(), lr=0.1))


def test_signalled_skip_leaves_the_step_unapplied(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)  # default rules: nonfinite -> skip
    gw.watcher(model).integrate(on_halt=pytest.fail, signalled=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        closure_step(model, opt, x[:32], y[:32])
    before = state(model, opt)
    closure_step(model, opt, x[:32], y[:32], poison=True)
    assert_same(before, state(model, opt))
    assert model[0].weight.grad is not None and model[0].weight.grad.isnan().any(), "gradients given back"
    closure_step(model, opt, x[:32], y[:32])
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    assert list(found.kind) == ["nonfinite"] and list(found.step) == [3] and list(found.action) == ["skip"]
    assert found.layer.iloc[0] == "0"


@pytest.mark.parametrize("signalled", [True, False], ids=["signalled", "optimizer-hook"])
def test_a_halt_calls_the_handler_instead_of_raising(run_dir: Path, signalled: bool) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
    halts: list[gw.TrainingHalted] = []
    watcher = gw.watcher(model)
    watcher.integrate(on_halt=halts.append, signalled=signalled)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = closure_step if signalled else plain_step
    for _ in range(4):
        step(model, opt, x[:32], y[:32])
    before = state(model, opt)
    step(model, opt, x[:32], y[:32], poison=True)  # no exception escapes
    assert_same(before, state(model, opt))  # the halted step applied nothing ...
    assert model[0].weight.grad is not None and model[0].weight.grad.isnan().any(), "... and gave the gradients back"
    assert [h.step for h in halts] == [4] and halts[0].finding is not None and halts[0].finding.kind == "nonfinite"
    assert watcher.closed
    plain_step(model, opt, x[:32], y[:32])  # later steps are not withheld any more
    assert not torch.equal(before["model"]["0.bias"], model[0].bias)
    run = gw.open_run(run_dir)
    assert run.status == "halted" and run.steps == 5
    assert run.verdict is not None and run.verdict["halted"]["step"] == 4


def test_a_halt_withholds_the_next_step_of_every_optimizer_of_the_model(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
    gw.watcher(model).integrate(on_halt=lambda halt: None)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    for poison in (False, True):
        first.zero_grad()
        second.zero_grad()
        nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        if poison:
            model[0].weight.grad[0, 0] = float("nan")
            before = copy.deepcopy(model.state_dict())
        first.step()
        second.step()  # the same iteration, after the halt: withheld too
    assert_same(before, model.state_dict())
    assert gw.open_run(run_dir).status == "halted"


def test_a_scaled_overflow_is_a_skipped_step_not_a_model_failure(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)
    watcher = gw.watcher(model)
    watcher.integrate(on_halt=pytest.fail, signalled=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        if step == 2:
            model[2].weight.grad[0, 0] = float("inf")
        watcher.gradients_ready(opt, scaled=True)
        if step != 2:  # a GradScaler does not call step() after an overflow
            opt.step()
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 4
    assert run.skipped_steps().tolist() == [2]
    found = run.findings()
    assert list(found.kind) == ["amp_overflow"] and list(found.severity) == ["info"] and list(found.step) == [2]


def test_leave_out_withholds_the_steps_a_rollback_skips(run_dir: Path) -> None:
    model, x, y = regression()
    rules = [gw.Rule(when="nonfinite", do="rollback", skip_batches=2)]
    gw.watch(model, run=run_dir, rules=rules, snapshot_every=1, console=False)
    watcher = gw.watcher(model)
    calls: list[int] = []

    def before_step() -> None:
        calls.append(watcher.step)
        watcher.leave_out()

    watcher.integrate(on_halt=pytest.fail, before_step=before_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    weights = []
    for step in range(7):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        if step == 3:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        weights.append(model[0].weight.detach().clone())
    assert calls == list(range(7)), "before_step runs once per step, before it is measured"
    assert torch.equal(weights[3], weights[1]), "rolled back to the snapshot taken before step 2's update"
    assert torch.equal(weights[4], weights[3]) and torch.equal(weights[5], weights[3]), \
        "the two steps after the rollback are left out"
    assert not torch.equal(weights[6], weights[5])
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.skipped_steps().tolist() == [3, 4, 5]
    assert run.series("lr")[0].tolist() == list(range(7)), "left-out steps have their learning rate"
    assert list(run.findings().kind) == ["nonfinite"], "left-out steps are not judged"
    assert watcher.pending_skips == 0


@pytest.mark.slow  # an explosion after a long baseline
def test_exploding_judges_the_norm_before_clipping_when_it_is_observed(tmp_path: Path) -> None:
    def train(run: Path, report_preclip: bool) -> gw.Run:
        torch.manual_seed(0)
        model, x, y = regression()
        gw.watch(model, run=run, rules=None, console=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(40):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[:32]), y[:32] * (1000.0 if step == 30 else 1.0))
            loss.backward()
            total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            if report_preclip:
                gw.watcher(model).observe(grad_norm_preclip=total)
            opt.step()
        gw.unwatch(model)
        return gw.open_run(run)

    for run in (train(tmp_path / "a", report_preclip=False), train(tmp_path / "b", report_preclip=True)):
        # measured by gradwatch (issue 15) or observed by the loop: the clip does not hide the spike
        found = run.findings()
        assert list(found.kind) == ["exploding"] and list(found.step) == [30]
        assert "before clipping" in found.message.iloc[0]
        assert max(run.series("grad_norm")[1]) <= 0.5 + 1e-5
        assert run.series("grad_norm_preclip")[1][30] > 100


def test_check_settings_refuses_what_watch_refuses() -> None:
    check_settings(rules=[gw.Rule(when="exploding", do="clip")], log_every=5, console=False)
    with pytest.raises(gw.ConfigError, match="queue_size"):
        check_settings(queue_size=0)
    with pytest.raises(gw.ConfigError):
        check_settings(rules=[{"when": "exploding", "do": "explode"}])
    with pytest.raises(gw.ConfigError):
        check_settings(log_every=0)
