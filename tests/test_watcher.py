"""The watcher's step lifecycle: schedules, observations, non-finite counts, host reads, exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradwatch as gw

from .conftest import train


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 4), torch.randn(16, 1)


def steps_with(run: gw.Run, metric: str, *, per_parameter: bool = False) -> list[int]:
    frame = run.metrics(metric, per_parameter=per_parameter, include_global=False)
    if per_parameter:
        frame = frame[frame.layer.str.contains(r"\.weight|\.bias")]
    return sorted(frame["step"].unique().tolist())


def test_log_and_sample_schedules(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, log_every=2, sample_every=4)
    train(model, data, nn.functional.mse_loss, steps=10)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 10
    assert steps_with(run, "grad_norm") == [0, 2, 4, 6, 8]
    for metric in ("grad_max", "param_norm", "update_ratio", "act_norm", "act_zero_frac"):
        assert steps_with(run, metric) == [0, 4, 8], metric
    assert steps_with(run, "grad_norm", per_parameter=True) == [0, 4, 8]
    assert run.scalars().index.tolist() == list(range(10)), "global scalars every step"
    info = run.step_info()
    assert info.logged.tolist() == [s % 2 == 0 for s in range(10)]
    assert info.sampled.tolist() == [s % 4 == 0 for s in range(10)]


def test_default_sampling_period_follows_log_every(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, log_every=3)
    train(model, data, nn.functional.mse_loss, steps=13)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.meta["options"]["sample_every"] == 12
    assert steps_with(run, "act_norm") == [0, 12]


def test_activations_can_be_turned_off(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, activations=False, sample_every=1)
    train(model, data, nn.functional.mse_loss, steps=3)
    assert not any(m._forward_hooks for m in model.modules() if m is not model)
    gw.unwatch(model)
    assert steps_with(gw.open_run(run_dir), "act_norm") == []


def test_activation_hooks_only_on_sampled_steps(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, sample_every=5)
    leaf_hooks = []

    def count(module: nn.Module, args: object, output: object) -> None:
        leaf_hooks.append(sum(len(m._forward_hooks) for m in model if m is not model))

    model.register_forward_hook(count)
    train(model, data, nn.functional.mse_loss, steps=7)
    assert leaf_hooks == [5, 0, 0, 0, 0, 5, 0]


def test_nonfinite_gradient_elements_are_counted(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, rules=None, console=False)  # record only: the NaN gets applied
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        x, y = data()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 1:
            model[2].weight.grad[0, :3] = float("nan")
            model[2].bias.grad[5] = float("inf")
        opt.step()
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    bad = run.metrics("grad_nonfinite", steps=slice(1, 2), per_parameter=True, include_global=False)
    counts = dict(zip(bad.layer, bad.value))
    assert counts == {"0": 0, "2": 4, "4": 0, "0.weight": 0, "0.bias": 0, "2.weight": 3, "2.bias": 1,
                      "4.weight": 0, "4.bias": 0}
    norms = run.metrics("grad_norm", steps=slice(1, 2))
    by_layer = dict(zip(norms.layer.fillna("global"), norms.value))
    assert np.isnan(by_layer["2"]) and np.isnan(by_layer["global"])
    assert np.isfinite(by_layer["0"]) and np.isfinite(by_layer["4"])
    before = run.metrics("grad_nonfinite", steps=slice(0, 1), include_global=False)
    assert (before.value == 0).all()
    after = run.metrics("grad_nonfinite", steps=slice(2, 3), include_global=False)
    assert (after.value > 0).all(), "SGD applied the NaN gradient: every layer is poisoned the step after"


def test_observe_numbers_and_tensors_are_averaged_per_step(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    watcher = gw.watcher(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watcher.observe(tokens=100)
    for step in range(3):
        x, y = data()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        watcher.observe(loss=loss, custom=torch.tensor(float(step)))
        watcher.observe(custom=10.0)
        opt.step()
        opt.zero_grad()
    gw.unwatch(model)
    scalars = gw.open_run(run_dir).scalars()
    assert scalars["custom"].tolist() == [5.0, 5.5, 6.0]
    assert scalars["tokens"].iloc[0] == 100 and scalars["tokens"].iloc[1:].isna().all()
    assert scalars["lr"].tolist() == [0.01] * 3


def test_dropped_gradients_without_a_step_count_as_a_skipped_step(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(data()[0]), torch.zeros(16, 1))
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        if step != 2:  # a loop that decides to drop this batch's gradients
            opt.step()
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.step_info().skipped.tolist() == [False, False, True, False, False]
    scalars = run.scalars()
    assert scalars["loss"].notna().all(), "the skipped step keeps its observed loss"
    assert np.isnan(scalars.loc[2, "grad_norm"])


class HostReads(TorchDispatchMode):
    """Counts ops that read a tensor value back to Python (``.item()``, ``float(t)``, ``bool(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def count_reads(watched: bool, run_dir: Path) -> int:
    torch.manual_seed(0)
    model = mlp()
    if watched:
        gw.watch(model, run=run_dir, sample_every=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # Adam itself reads its step counter on CPU
    loop = train if watched else plain_loop
    loop(model, data, nn.functional.mse_loss, steps=2, optimizer=opt)  # warm-up outside the mode
    with HostReads() as mode:
        loop(model, data, nn.functional.mse_loss, steps=6, optimizer=opt)
    return mode.reads


def plain_loop(model, batches, loss_fn, *, steps, optimizer):  # type: ignore[no-untyped-def]
    for _ in range(steps):
        x, y = batches()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def test_no_scalar_reads_in_hooks_or_steps(run_dir: Path) -> None:
    """gradwatch adds no ``.item()``-style read: its one read per step is a bulk copy of a stacked vector."""
    assert count_reads(True, run_dir) == count_reads(False, run_dir)


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import gradwatch as gw
    model = gw.watch(nn.Linear(3, 1), run=sys.argv[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(7):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        opt.zero_grad(); loss.backward(); gw.watcher(model).observe(loss=loss); opt.step()
    if sys.argv[2] == "raise":
        raise RuntimeError("training script failed")
    """
)


@pytest.mark.slow  # a training subprocess per case
@pytest.mark.parametrize(("how", "status", "code"), [("end", "finished", 0), ("raise", "crashed", 1)])
def test_runs_are_closed_at_interpreter_exit(tmp_path: Path, how: str, status: str, code: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), how], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == code
    run = gw.open_run(tmp_path / "run")
    assert run.steps == 7 and run.status == status
    assert len(run.metrics("grad_norm", include_global=False)) == 7
    assert not (tmp_path / "run" / "gradwatch.sqlite-wal").exists(), "closed runs are one self-contained file"


def test_an_internal_error_detaches_gradwatch_and_training_goes_on(run_dir: Path, monkeypatch) -> None:
    model = gw.watch(mlp(), run=run_dir)
    opt = train(model, data, nn.functional.mse_loss, steps=3)
    from gradwatch.step import stats

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated gradwatch bug")

    monkeypatch.setattr(stats, "norms", broken)
    with pytest.warns(gw.InternalWarning, match="simulated gradwatch bug.*training continues"):
        for _ in range(3):
            x, y = data()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # the failing step is still applied, unchanged
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    run = gw.open_run(run_dir)
    assert run.status == "crashed" and run.steps == 3


def test_a_model_dropped_while_watched_closes_its_run(run_dir: Path) -> None:
    import gc
    import weakref

    from gradwatch.watching import registry

    model = gw.watch(mlp(), run=run_dir)
    train(model, data, nn.functional.mse_loss, steps=3)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and not registry._live
    run = gw.open_run(run_dir)
    assert run.status == "finished" and run.steps == 3


@pytest.mark.parametrize("rules", ["default", None, [gw.Rule(when="*", do="clip", max_norm=1e-3)]])
def test_a_finished_steps_gradients_are_freed_by_zero_grad(run_dir: Path, rules: object) -> None:
    """Nothing in gradwatch keeps last step's gradients alive beside the next backward's."""
    # the objects that exist before the test (the session's: torch, pytest ...) are left out of the
    # collections below, which would otherwise go through all of them every step (0.2 s each); all
    # that the test makes, the model and gradwatch's watcher included, is collected as usual
    gc.freeze()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        gw.watch(model, run=run_dir, rules=rules, console=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        for step in range(12):  # sampled and unsampled steps
            nn.functional.mse_loss(model(x), y).backward()
            refs = [weakref.ref(p.grad) for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            assert all(ref() is None for ref in refs), f"step {step}: a gradient outlived zero_grad"
        gw.unwatch(model)
    finally:
        gc.unfreeze()


def test_flush_writes_every_step_trained_so_far(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir, sample_every=4)
    opt = train(model, data, nn.functional.mse_loss, steps=9)  # step 8 is sampled: its update norms pend
    gw.watcher(model).flush()
    run = gw.open_run(run_dir)
    assert run.steps == 9, "the last step is on disk once its optimizer step has returned"
    assert steps_with(run, "update_ratio") == [0, 4, 8]
    # a flush between backward and optimizer.step(): that step is recorded later, as usual
    x, y = data()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    gw.watcher(model).flush()
    assert gw.open_run(run_dir).steps == 9
    opt.step()
    train(model, data, nn.functional.mse_loss, steps=3, optimizer=opt)
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 13
    assert run.scalars().index.tolist() == list(range(13))
    assert steps_with(run, "update_ratio") == [0, 4, 8, 12]


def test_flush_between_two_optimizers_leaves_the_step_open(run_dir: Path) -> None:
    model = gw.watch(mlp(), run=run_dir)
    first = torch.optim.SGD(list(model[0].parameters()), lr=0.01)
    rest = torch.optim.SGD([p for m in list(model)[1:] for p in m.parameters()], lr=0.01)
    for _ in range(4):
        x, y = data()
        first.zero_grad()
        rest.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        first.step()
        gw.watcher(model).flush()  # the second optimizer has yet to step: the step stays open
        rest.step()
    gw.watcher(model).flush()
    assert gw.open_run(run_dir).steps == 4
    gw.unwatch(model)
    run = gw.open_run(run_dir)
    assert run.steps == 4
    assert run.findings().empty


def test_leaf_hooks_are_in_place_on_sampled_steps_only_beside_the_users_own(run_dir: Path) -> None:
    """The activation hooks go into the leaves' hook dicts for a sampled step and out after it;
    a hook of the user's on the same leaf runs on every call and is the only one left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gw.watch(model, run=run_dir, console=False, sample_every=3)
    calls: list[int] = []
    user = model[0].register_forward_hook(lambda m, args, out: calls.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    in_place = {}
    for step in range(7):
        out = model(torch.randn(8, 4))
        in_place[step] = (len(model[0]._forward_hooks), len(model[2]._forward_hooks))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert in_place == {s: (2, 1) if s % 3 == 0 else (1, 0) for s in range(7)}
    assert len(calls) == 7 and list(model[0]._forward_hooks) == [user.id]
    gw.unwatch(model)
    assert list(model[0]._forward_hooks) == [user.id] and not model[2]._forward_hooks
    act = gw.open_run(run_dir).metrics("act_norm")
    assert sorted(act.loc[act["layer"] == "2", "step"].unique()) == [0, 3, 6]
