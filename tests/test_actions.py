"""Actions act on the step before the optimizer applies it: skip, rollback, halt, clip, scale_lr."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw


def regression(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(512, 1)
    return model, x, y


def batch(x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
    return x[idx], y[idx]


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             poison: bool = False) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("nan")
    gw.watcher(model).observe(loss=loss)
    opt.step()
    return loss.detach()


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}


def assert_same(a: Any, b: Any) -> None:
    """Bit-for-bit equality of nested state dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), "tensors differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    else:
        assert a == b


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
], ids=["sgd-momentum-wd", "adam", "adamw"])
def test_skip_leaves_parameters_and_optimizer_state_bitwise_unchanged(run_dir: Path, make_opt: Any) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)  # default rules: nonfinite -> skip
    opt = make_opt(model.parameters())
    for step in range(12):
        xb, yb = batch(x, y, step)
        if step == 7:
            before = state(model, opt)
            one_step(model, opt, xb, yb, poison=True)
            assert_same(before, state(model, opt))
            assert model[0].weight.grad is not None and model[0].weight.grad.isnan().any(), "gradients given back"
        else:
            one_step(model, opt, xb, yb)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    found = run.findings()
    assert list(found.kind) == ["nonfinite"] and list(found.step) == [7] and list(found.action) == ["skip"]
    assert run.step_info().set_index("step").loc[7, "skipped"]
    assert not run.step_info().set_index("step").drop(index=7)["skipped"].any()


def test_halt_raises_at_the_step_before_the_update_and_closes_the_run(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="nonfinite", do="halt")], console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        one_step(model, opt, *batch(x, y, step))
    before = state(model, opt)
    with pytest.raises(gw.TrainingHalted) as info:
        one_step(model, opt, *batch(x, y, 5), poison=True)
    assert isinstance(info.value, RuntimeError) and info.value.step == 5
    assert info.value.finding.kind == "nonfinite"
    assert_same(before, state(model, opt))
    run = gw.open_run(run_dir)
    assert run.status == "halted"
    assert run.verdict is not None and run.verdict["halted"]["step"] == 5 and run.verdict["worst"] == "error"
    found = run.findings()
    assert list(found.action) == ["halt"] and list(found.step) == [5]
    assert 5 in set(run.step_info().step)
    with pytest.raises(gw.ConfigError):
        gw.watcher(model)  # the watcher is closed
    one_step_plain = nn.functional.mse_loss(model(x[:4]), y[:4])  # the model still works unwatched
    assert torch.isfinite(one_step_plain)


@pytest.mark.slow  # trains to convergence
def test_rollback_restores_the_last_snapshot_and_training_converges(run_dir: Path) -> None:
    model, x, y = regression()
    rules = [gw.Rule(when="nonfinite", do="rollback", skip_batches=2, lr_scale=0.5)]
    gw.watch(model, run=run_dir, rules=rules, snapshot_every=5, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    taken: dict[int, dict[str, Any]] = {}

    def capture(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = gw.watcher(model).step - 1
        if step == 20:  # gradwatch snapshots steps 0, 5, 10, 15, 20 (before their update)
            taken["s20"] = {**state(model, opt), "sched": copy.deepcopy(sched.state_dict()),
                            "rng": torch.get_rng_state()}

    opt.register_step_pre_hook(capture)
    watcher = gw.watcher(model)
    losses, used = [], []
    batches = list(range(200))
    step = 0
    for b in watcher.batches(batches):
        if step >= 120:
            break
        used.append(b)
        loss = one_step(model, opt, *batch(x, y, b), poison=(step == 23))
        if step == 23:
            after = state(model, opt)
            assert_same(taken["s20"]["model"], after["model"])
            s20_opt = taken["s20"]["opt"]
            assert_same(s20_opt["state"], after["opt"]["state"])
            assert after["opt"]["param_groups"][0]["lr"] == pytest.approx(s20_opt["param_groups"][0]["lr"] * 0.5)
            assert sched.last_epoch == taken["s20"]["sched"]["last_epoch"]
            assert torch.equal(torch.get_rng_state(), taken["s20"]["rng"]), "the RNG state is restored"
        sched.step()
        losses.append(float(loss))
        step += 1
    assert used[23] == 23 and used[24] == 26, "the two batches after the rollback are skipped"
    assert math.isfinite(losses[-1]) and sum(losses[-10:]) < 0.5 * sum(losses[:10])
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    found = run.findings()
    row = found.iloc[0]
    assert (row.kind, row.step, row.action) == ("nonfinite", 23, "rollback")
    assert row.data["outcome"]["restored_step"] == 20
    assert run.verdict["rollbacks"] == 1
    assert run.steps == 120, "the step counter keeps counting loop iterations"


def test_rollback_restores_the_grad_scaler(run_dir: Path) -> None:
    model, x, y = regression()
    rules = [gw.Rule(when="exploding", do="rollback")]
    gw.watch(model, run=run_dir, rules=rules, snapshot_every=5, detectors={"exploding": {"warmup": 10}},
             console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales: dict[int, float] = {}
    for step in range(30):
        scales[step] = scaler.get_scale()  # what a snapshot taken at this step holds
        xb, yb = batch(x, y, step)
        if step == 23:
            yb = yb * 1000.0  # a finite explosion: the scaler lets it through, the rule rolls back
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(xb), yb)).backward()
        scaler.step(opt)
        if step == 23:
            assert scales[23] > scales[20], "the scale grew after the snapshot"
            assert scaler.get_scale() == scales[20], "the rollback restored the scaler's state of step 20"
        scaler.update()
    gw.unwatch(model)
    row = gw.open_run(run_dir).findings().iloc[0]
    assert (row.kind, row.step, row.action) == ("exploding", 23, "rollback")
    assert row.data["outcome"]["restored_step"] == 20


def test_rollback_gives_up_after_max_rollbacks(run_dir: Path) -> None:
    model, x, y = regression()
    rules = [gw.Rule(when="nonfinite", do="rollback", max_rollbacks=2)]
    gw.watch(model, run=run_dir, rules=rules, snapshot_every=3, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(gw.TrainingHalted, match="more than 2 rollbacks"):
        for step in range(40):
            one_step(model, opt, *batch(x, y, step), poison=step >= 10)
    run = gw.open_run(run_dir)
    assert run.status == "halted" and run.verdict["rollbacks"] == 2


def test_rollback_snapshots_on_disk_are_checksummed(run_dir: Path, tmp_path: Path) -> None:
    model, x, y = regression()
    snaps = tmp_path / "snaps"
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="nonfinite", do="rollback")], snapshot_every=4,
             snapshot_dir=str(snaps), console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(10):
        one_step(model, opt, *batch(x, y, step))
    files = sorted(snaps.glob("snapshot-*.pt"))
    assert [f.name for f in files] == ["snapshot-000000004.pt", "snapshot-000000008.pt"]
    assert not list(snaps.glob("*.tmp"))
    files[-1].write_bytes(files[-1].read_bytes()[:-10] + b"corrupted!")
    one_step(model, opt, *batch(x, y, 10), poison=True)  # a corrupted snapshot is never restored
    gw.watcher(model).flush()
    outcome = gw.open_run(run_dir).findings().iloc[0].data["outcome"]
    assert outcome["restored_step"] == 4 and "checksum" in outcome["refused"][0]
    for f in files:
        f.write_bytes(b"garbage")
    with pytest.raises(gw.TrainingHalted, match="no intact snapshot"):
        one_step(model, opt, *batch(x, y, 11), poison=True)
    assert gw.open_run(run_dir).status == "halted"


def diverging_run(run_dir: Path, rules: Any) -> list[float]:
    """Linear regression whose LR jumps 300x at step 60: plain SGD diverges to inf/NaN."""
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=rules, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 60 else 300.0)
    losses = []
    for step in range(120):
        losses.append(float(one_step(model, opt, *batch(x, y, step))))
        sched.step()
    gw.unwatch(model)
    return losses


@pytest.mark.slow  # hundreds of diverging steps
def test_adaptive_clip_keeps_a_diverging_run_finite(tmp_path: Path) -> None:
    plain = diverging_run(tmp_path / "plain", rules=None)
    assert not all(math.isfinite(v) for v in plain), "without clipping the run diverges"
    clipped = diverging_run(tmp_path / "clip", rules=[gw.Rule(when="exploding", do="clip")])
    assert all(math.isfinite(v) for v in clipped)
    found = gw.open_run(tmp_path / "clip").findings()
    clips = found[found.kind == "exploding"]
    assert len(clips) and clips.step.min() >= 60 and set(clips.action) == {"clip"}
    assert clips.iloc[0].data["outcome"]["clipped"] is True


def test_fixed_clip_bounds_the_applied_gradient(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="*", do="clip", max_norm=0.01)],
             detectors={"exploding": {"limit": 0.5}}, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))))
    for step in range(3):
        xb, yb = batch(x, y, step)
        one_step(model, opt, xb * 100, yb * 100)  # huge gradients: above the absolute limit
    assert max(seen) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.slow  # a long run around a NaN
def test_a_nan_step_does_not_poison_detection_or_adaptive_clipping(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, console=False)  # default: nonfinite -> skip, exploding -> clip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(80):
        xb, yb = batch(x, y, step)
        if step == 60:
            yb = yb * 1000  # a corrupted batch: the gradient norm jumps ~1000x
        one_step(model, opt, xb, yb, poison=(step == 30))
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    assert list(zip(found.kind, found.step, found.action)) == [
        ("nonfinite", 30, "skip"), ("exploding", 60, "clip"), ("loss_spike", 60, "warn")]
    outcome = found.iloc[1].data["outcome"]
    assert outcome["clipped"] and outcome["adaptive"] and math.isfinite(outcome["max_norm"])


def test_scale_lr_multiplies_the_learning_rate(run_dir: Path) -> None:
    model, x, y = regression()
    gw.watch(model, run=run_dir, rules=[gw.Rule(when="loss_spike", do="scale_lr", factor=0.5)], console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(50):
        xb, yb = batch(x, y, step)
        one_step(model, opt, xb, yb * (100 if step == 40 else 1))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    gw.unwatch(model)
    found = gw.open_run(run_dir).findings()
    spikes = found[found.kind == "loss_spike"]
    assert list(zip(spikes.step, spikes.action)) == [(40, "scale_lr")]


def test_rules_none_never_changes_training(tmp_path: Path) -> None:
    def run(watch: bool) -> dict[str, Any]:
        model, x, y = regression()
        if watch:
            gw.watch(model, run=tmp_path / "w", rules=None, console=False)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(15):
            xb, yb = batch(x, y, step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb * (1000 if step == 12 else 1))
            loss.backward()
            if step == 9:
                model[0].weight.grad[0, 0] = float("nan")
            if watch:
                gw.watcher(model).observe(loss=loss)
            opt.step()
        if watch:
            gw.unwatch(model)
        return state(model, opt)

    bare, watched = run(False), run(True)
    torch.testing.assert_close(bare["model"], watched["model"], equal_nan=True, rtol=0, atol=0)
    found = gw.open_run(tmp_path / "w").findings()
    assert "nonfinite" in set(found.kind) and set(found.action) == {"warn"}
