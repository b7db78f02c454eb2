"""Many forward calls per optimizer step (a policy-gradient rollout of single-sample calls).

Origin tracking captures the first sixteen calls of a step; during the calls after them gradwatch's
root hooks are out of the module until the next backward pass or optimizer step. What must not change:
every step is recorded, a sampled step's activation statistics cover every call, a NaN born in a
captured call is replayed to its origin, and one born in a later call is still found at its step.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.rootcause.capture import KEEP_GRADS, MAX_CAPTURES

CALLS = 40  # forward calls per optimizer step: more than origin tracking captures


def policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def rollout(model: nn.Module, run_dir: Path, steps: int, *, plant: tuple[int, int] | None = None,
            micro: int = 1, outputs: dict[int, list[torch.Tensor]] | None = None, **kw: object) -> gw.Run:
    """Train: each optimizer step is ``micro`` backward passes of ``CALLS`` single-sample forward calls each.

    ``plant`` = (step, call) puts a NaN in that call's input; ``outputs`` collects the first layer's
    outputs per step.
    """
    gw.watch(model, run=run_dir, console=False, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    first = model[0]
    handle = first.register_forward_hook(
        lambda m, a, out: outputs.setdefault(step, []).append(out.detach().clone())) if outputs is not None else None
    for step in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            logps = []
            for call in range(CALLS):
                x = torch.randn(1, 4, generator=gen)
                if plant == (step, call):
                    x[0, 1] = float("nan")
                logps.append(torch.log_softmax(model(x), -1)[0, call % 2])
            loss = -torch.stack(logps).mean()
            (loss / micro).backward()
            gw.watcher(model).observe(loss=loss)
        opt.step()
    if handle is not None:
        handle.remove()
    gw.unwatch(model)
    return gw.open_run(run_dir)


def test_every_step_is_recorded_and_a_sampled_step_measures_every_call(run_dir: Path) -> None:
    outputs: dict[int, list[torch.Tensor]] = {}
    run = rollout(policy(), run_dir, 12, outputs=outputs)
    records = {r.step: r for r in run.records()}
    assert sorted(records) == list(range(12))
    assert run.findings().empty
    sampled = records[10]
    assert sampled.sampled
    layer = run.layers.index("0")
    calls = outputs[10]
    assert len(calls) == CALLS
    expected = float(torch.sqrt(sum((c.double() ** 2).sum() for c in calls)))
    assert np.isclose(sampled.vector("act_norm")[layer], expected, rtol=1e-5)
    relu = run.layers.index("1")
    zeros = sum(int((torch.relu(c) == 0).sum()) for c in calls) / sum(c.numel() for c in calls)
    assert np.isclose(sampled.vector("act_zero_frac")[relu], zeros)


def test_gradient_accumulation_over_rollouts_counts_optimizer_steps(run_dir: Path) -> None:
    run = rollout(policy(), run_dir, 6, micro=3)
    assert run.steps == 6
    assert [r.step for r in run.records()] == list(range(6))
    assert run.findings().empty


def test_a_nan_in_a_captured_call_is_replayed_to_the_input(run_dir: Path) -> None:
    """The call is not the step's first: a replay of the first (finite) must not end the search."""
    run = rollout(policy(), run_dir, 6, plant=(4, 3), rules=None)
    row = run.findings().iloc[0]
    assert (row.kind, row.step, row.phase) == ("nonfinite", 4, "forward")
    assert "input batch" in row.message


def test_a_nan_in_a_call_after_the_captured_ones_is_found_at_its_step(run_dir: Path) -> None:
    late = MAX_CAPTURES + 10
    assert late < CALLS
    run = rollout(policy(), run_dir, 6, plant=(4, late), rules=None)
    found = run.findings()
    row = found.iloc[0]
    assert (row.kind, row.step) == ("nonfinite", 4)
    # the captured calls replay finite; the verdict says the NaN came from a call that was not kept,
    # not (as a single-call step would) that the loss function made it
    assert row.data["origin"] == "attributed"
    detail = row.data["root_cause"]["cause_detail"]
    assert f"first {MAX_CAPTURES} forward calls stayed finite" in detail
    assert "it had more, which origin tracking does not keep" in detail


def test_the_root_hooks_step_aside_while_quiet_and_come_back_in_their_place(run_dir: Path) -> None:
    """After the calls origin tracking captures, gradwatch's root hooks leave the model's hook dicts
    (a forward call then takes nn.Module's path without hooks); at the backward pass they are back
    where they were, before a hook the user registered after watching, which runs on every call."""
    model = policy()
    gw.watch(model, run=run_dir, console=False)
    seen: list[int] = []
    user = model.register_forward_pre_hook(lambda m, args: seen.append(len(seen)))
    before = (list(model._forward_pre_hooks), list(model._forward_hooks))
    assert len(before[0]) == 2 and before[0][-1] == user.id
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        outs = []
        for call in range(CALLS):
            outs.append(model(torch.randn(1, 4)).sum())
            if call == MAX_CAPTURES + 2:  # past the captured calls: only the user's hook is left
                assert list(model._forward_pre_hooks) == [user.id] and not model._forward_hooks
        torch.stack(outs).sum().backward()
        assert (list(model._forward_pre_hooks), list(model._forward_hooks)) == before
        opt.step()
    assert len(seen) == 3 * CALLS  # the user's hook ran on every call
    assert gw.watcher(model).step == 3
    gw.unwatch(model)
    assert list(model._forward_pre_hooks) == [user.id] and not model._forward_hooks


class _Trap(torch.autograd.Function):
    """Identity on ``h``; in backward, a NaN gradient for a sample whose input's first feature is 7."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return h.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return torch.where(x[:, :1] == 7.0, torch.full_like(grad, float("nan")), grad), None


class Trap(nn.Module):
    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _Trap.apply(h, x)


class TrappedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.act, self.trap, self.out = nn.Linear(4, 16), nn.Tanh(), Trap(), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.trap(self.act(self.inp(x)), x))


@pytest.mark.parametrize("remove_first", [False, True])
def test_hooks_registered_or_removed_while_gradwatchs_are_out_keep_their_order(run_dir: Path,
                                                                               remove_first: bool) -> None:
    """A hook registered before watching stays before gradwatch's; one registered while gradwatch's
    is out comes after it; removing the first while gradwatch's is out changes neither."""
    model = policy()
    first = model.register_forward_pre_hook(lambda m, args: None)
    gw.watch(model, run=run_dir, console=False)
    ours = list(model._forward_pre_hooks)[1]
    outs = []
    for call in range(MAX_CAPTURES + 3):
        outs.append(model(torch.randn(1, 4)).sum())
        if call == MAX_CAPTURES + 1:  # gradwatch's hook is out
            assert ours not in model._forward_pre_hooks
            late = model.register_forward_pre_hook(lambda m, args: None)
            if remove_first:
                first.remove()
    torch.stack(outs).sum().backward()
    expected = ([] if remove_first else [first.id]) + [ours, late.id]
    assert list(model._forward_pre_hooks) == expected
    gw.unwatch(model)


def test_the_root_hooks_stay_in_place_when_another_thread_runs_the_model(run_dir: Path) -> None:
    """Only the thread that watches takes the root's hooks out: replicas run in other threads
    (DataParallel) share the module's hook dicts."""
    model = policy()
    gw.watch(model, run=run_dir, console=False)
    ours = list(model._forward_pre_hooks)
    seen: list[list[int]] = []

    def work() -> None:
        outs = [model(torch.randn(1, 4)).sum() for _ in range(MAX_CAPTURES + 3)]
        seen.append(list(model._forward_pre_hooks))
        torch.stack(outs).sum().backward()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [ours]
    gw.unwatch(model)


@pytest.mark.parametrize(("call", "kept"), [(2, True), (KEEP_GRADS + 6, False)])
def test_a_nan_born_in_backward_of_a_captured_call_is_located(run_dir: Path, call: int, kept: bool) -> None:
    """The first calls of a step keep the gradient arriving at their output; a small call after
    them keeps none (a hook costs more than the call) and is replayed with a substitute output
    gradient, which still finds the layer whose backward made the NaN, and says so."""
    torch.manual_seed(0)
    model = TrappedPolicy()
    gw.watch(model, run=run_dir, console=False, rules=None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        opt.zero_grad()
        outs = []
        for k in range(CALLS):
            x = torch.randn(1, 4, generator=gen)
            if (step, k) == (2, call):
                x[0, 0] = 7.0
            outs.append(model(x).sum())
        torch.stack(outs).sum().backward()
        opt.step()
    gw.unwatch(model)
    row = gw.open_run(run_dir).findings().iloc[0]
    assert (row.kind, row.step, row.phase, row.layer) == ("nonfinite", 2, "backward", "trap")
    assert row.data["origin"] == "replayed"
    assert ("substitute output gradient" in row.data.get("note", "")) == (not kept)
