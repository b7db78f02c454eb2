"""The layout follows the model while it trains: parameters frozen or unfrozen after ``gw.watch``,
a layer replaced after the optimizer was built (the fine-tuning loops where a stale layout made a
false ``unused_parameter`` or missed an ``unoptimized_parameter``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.step import relayout


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int,
          before: Callable[[int], None] | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if before is not None:
            before(step)
        x = torch.randn(32, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()


def loud(run_dir: Path) -> list[tuple[str, int, str | None, str | None]]:
    found = gw.open_run(run_dir).findings()
    return [(r.kind, r.step, r.layer, r.data.get("reason")) for r in found.itertuples() if r.severity != "info"]


def freeze(module: nn.Module, frozen: bool = True) -> None:
    for p in module.parameters():
        p.requires_grad = not frozen


def test_a_layer_frozen_after_watch_is_not_called_unused(run_dir: Path) -> None:
    model = net()
    gw.watch(model, run=run_dir, console=False)
    freeze(model[0])  # the backbone, frozen after watching
    train(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01), 20)
    gw.unwatch(model)
    assert loud(run_dir) == []
    run = gw.open_run(run_dir)
    assert run.layout().trainable == (False, False, True, True)


@pytest.mark.parametrize(("lr", "reason"), [(None, "not_in_optimizer"), (0.0, "zero_update")])
def test_a_layer_unfrozen_later_and_not_trained_is_found(run_dir: Path, lr: float | None, reason: str) -> None:
    """Frozen when watching began, unfrozen at step 20, then left out of the optimizer (its gradients
    pile up, never applied) or given a param group whose learning rate is 0."""
    model = net()
    freeze(model[0])
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.01)

    def unfreeze(step: int) -> None:
        if step == 20:
            freeze(model[0], False)
            if lr is not None:
                opt.add_param_group({"params": list(model[0].parameters()), "lr": lr})

    train(model, opt, 40, unfreeze)
    gw.unwatch(model)
    assert loud(run_dir) == [("unoptimized_parameter", 20, "0", reason)]  # at once: step 20 is sampled


def test_a_head_replaced_after_the_optimizer_was_built_is_found_as_itself(run_dir: Path) -> None:
    """The new head is in no optimizer: found at once, with its own size; the old head's parameters,
    gone from the model, are not called unused."""
    model = net()
    gw.watch(model, run=run_dir, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model[2] = nn.Linear(16, 1)  # a new head for the new task
    train(model, opt, 12)
    gw.unwatch(model)
    assert loud(run_dir) == [("unoptimized_parameter", 0, "2", "not_in_optimizer")]
    run = gw.open_run(run_dir)
    assert run.layout().param_numel == (128, 16, 16, 1)
    assert "(17 elements)" in run.findings().iloc[0]["message"]


def test_a_branch_taken_on_alternate_steps_is_looked_at_once_per_sampling_period(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters without a gradient change every step: the layout is looked at (a re-discovery
    of the model) at most once per ``sample_every`` steps, and stays the same."""
    looks = []
    discover = relayout.discover
    monkeypatch.setattr(relayout, "discover", lambda model, version: looks.append(version) or discover(model, version))

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return (self.a if self.calls % 2 else self.b)(torch.relu(self.body(x)))

    torch.manual_seed(0)
    model = TwoHeads()
    gw.watch(model, run=run_dir, console=False)
    train(model, torch.optim.SGD(model.parameters(), lr=0.01), 40)
    gw.unwatch(model)
    assert len(looks) == 4  # steps 0, 10, 20, 30
    assert loud(run_dir) == []
    assert gw.open_run(run_dir).layout().version == 1
