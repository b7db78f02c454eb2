"""A model changed during the run is followed (issue 34): each kind of change a training loop makes to its
model at step 20 of 40, in a small real loop, read back as the user reads it: the run finished with every
step, no warning on a healthy change, training bit-identical to the loop without gradwatch, and the
statistics of the model as it is now (the new head's gradients, activations and update ratios)."""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn.utils import prune

import gradwatch as gw
from gradwatch.cli import check as _registers_check  # noqa: F401
from gradwatch.cli import cli
from gradwatch.errors import InternalWarning

V, D, STEPS, AT = 12, 12, 40, 20
LAYERS = ("embed", "body", "head")
SAMPLED = (20, 30)  # the sampled steps from the change on (sample_every is 10)


class Net(nn.Module):
    """An embedding, a hidden layer and a classifier head; the head runs in its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        nn.init.normal_(self.embed.weight, std=D ** -0.5)  # the head's scale: tying them changes no magnitude
        self.body = nn.Linear(D, D)
        self.act = nn.Tanh()
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.body(self.embed(tokens)))
        out = self.head(hidden.to(self.head.weight.dtype))
        self.out = out.detach()  # the test's own copy of the head's output (a plain attribute)
        return out.float()


@dataclass
class Loop:
    """What a training loop holds, and may rebuild at the change."""

    model: Net
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler | None = None
    set_to_none: bool = True
    kept: dict[str, torch.Tensor] = field(default_factory=dict)


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]


def frozen_body(loop: Loop) -> None:
    loop.model.body.requires_grad_(False)


def unfreeze(loop: Loop) -> None:
    loop.model.body.requires_grad_(True)


def add_group(loop: Loop) -> None:  # progressive unfreezing: the body joins the optimizer as a new group
    loop.model.body.requires_grad_(True)
    loop.opt.add_param_group({"params": list(loop.model.body.parameters()), "lr": 5e-3})


def new_optimizer(loop: Loop) -> None:  # the old optimizer and its scheduler are dropped
    loop.opt = torch.optim.SGD(loop.model.parameters(), lr=0.05, momentum=0.9)
    loop.sched = torch.optim.lr_scheduler.StepLR(loop.opt, step_size=5, gamma=0.5)


def replace_head(rebuild: bool) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        loop.model.head = nn.Linear(D, V)  # a new head for a new task
        if rebuild:
            loop.opt = adam(loop.model.parameters())
    return change


def tie(rebuild: bool) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        loop.model.head.weight = loop.model.embed.weight
        if rebuild:
            loop.opt = adam(loop.model.parameters())
    return change


def reload(assign: bool) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:  # a checkpoint round trip: model and optimizer state loaded back
        state, opt_state = copy.deepcopy(loop.model.state_dict()), copy.deepcopy(loop.opt.state_dict())
        loop.model.load_state_dict(state, assign=assign)
        if assign:  # new parameter objects: the optimizer is rebuilt for them and given its state back
            loop.opt = adam(loop.model.parameters())
            loop.opt.load_state_dict(opt_state)
    return change


def cast(dtype: torch.dtype) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:  # the head in another dtype, in place; its optimizer rebuilt for it (an
        loop.model.head.to(dtype)     # eps that float16 holds: Adam's 1e-8 underflows there, its update is NaN)
        loop.opt = torch.optim.Adam(loop.model.parameters(), lr=1e-2, eps=1e-4)
    return change


def pruned(loop: Loop) -> None:  # weight becomes weight_orig (the same Parameter) times a mask buffer
    prune.l1_unstructured(loop.model.body, "weight", amount=0.5)


@dataclass(frozen=True)
class Case:
    change: Callable[[Loop], None]
    start: Callable[[Loop], None] | None = None  # before step 0
    set_to_none: bool = True
    only: tuple[str, ...] | None = None  # the first optimizer holds only these modules' parameters
    scheduled: bool = False


HEALTHY = {
    "freeze": Case(frozen_body),
    "freeze-keep-zeros": Case(frozen_body, set_to_none=False),
    "unfreeze": Case(unfreeze, start=frozen_body),
    "unfreeze-keep-zeros": Case(unfreeze, start=frozen_body, set_to_none=False),
    "add_param_group": Case(add_group, start=frozen_body, only=("embed", "head")),
    "new-optimizer-and-scheduler": Case(new_optimizer, scheduled=True),
    "replace-head": Case(replace_head(True)),
    "tie": Case(tie(False)),
    "tie-new-optimizer": Case(tie(True)),
    "load_state_dict": Case(reload(False)),
    "load_state_dict-assign": Case(reload(True)),
    "cast-double": Case(cast(torch.float64)),
    "cast-half": Case(cast(torch.float16)),
    "prune": Case(pruned),
}


@dataclass
class Expected:
    """What the test computes itself, in float64, at each step: per layer its gradient norm (None: no
    gradient), the head's output norm, and per layer its update ratio."""

    grads: dict[int, dict[str, float | None]] = field(default_factory=dict)
    acts: dict[int, float] = field(default_factory=dict)
    ratios: dict[int, dict[str, float]] = field(default_factory=dict)


def _own(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None]


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.detach().double().flatten() for t in tensors])))


def train(case: Case, run: Path | None, steps: int = STEPS, at: int = AT) -> tuple[Net, Expected]:
    torch.manual_seed(0)
    model = Net()
    if run is not None:
        gw.watch(model, run=run, console=False)
    loop = Loop(model, adam(model.parameters()), set_to_none=case.set_to_none)
    if case.start is not None:
        case.start(loop)
    if case.only is not None:
        loop.opt = adam([p for name in case.only for p in getattr(model, name).parameters()])
    if case.scheduled:
        loop.sched = torch.optim.lr_scheduler.LambdaLR(loop.opt, lambda step: 1.0 / (1 + 0.05 * step))
    gen = torch.Generator().manual_seed(1)
    seen = Expected()
    for step in range(steps):
        if step == at:
            case.change(loop)
        tokens = torch.randint(0, V, (32,), generator=gen)
        loss = nn.functional.cross_entropy(loop.model(tokens), (tokens + 1) % V)
        loop.opt.zero_grad(set_to_none=loop.set_to_none)
        loss.backward()
        if run is not None:
            gw.watcher(loop.model).observe(loss=loss)
        modules = {name: getattr(loop.model, name) for name in LAYERS}
        seen.grads[step] = {name: _norm([p.grad for p in _own(m) if p.grad is not None])
                            if any(p.grad is not None for p in _own(m)) else None for name, m in modules.items()}
        seen.acts[step] = _norm([loop.model.out])
        before = {name: [p.detach().clone() for p in _own(m)] for name, m in modules.items()}
        loop.opt.step()
        if loop.sched is not None:
            loop.sched.step()
        seen.ratios[step] = {name: _norm([a - b.double() for a, b in zip(_own(m), before[name])]) / _norm(before[name])
                             for name, m in modules.items() if all(p.requires_grad for p in _own(m))}
    if run is not None:
        gw.unwatch(loop.model)
    return loop.model, seen


def watched(case: Case, run: Path) -> tuple[gw.Run, Expected]:
    """Train with gradwatch (no InternalWarning), and check the same loop without it trains bit-identically."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, seen = train(case, run)
    assert not [w for w in caught if issubclass(w.category, InternalWarning)]
    bare, _ = train(case, None)
    mine, theirs = model.state_dict(), bare.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    opened = gw.open_run(run)
    assert (opened.status, opened.steps) == ("finished", STEPS)
    return opened, seen


def loud(run: gw.Run) -> list[tuple[str, int, str | None]]:
    return [(f.kind, f.step, f.layer) for f in run.findings().itertuples() if f.severity != "info"]


def recorded(run: gw.Run, metric: str) -> dict[tuple[int, str], float]:
    rows = run.metrics(metric, include_global=False)
    return {(int(r.step), r.layer): float(r.value) for r in rows.itertuples()}


def follows(run: gw.Run, seen: Expected, *, unoptimized: bool = False) -> None:
    """The statistics are those of the model as it is at each step: every layer's gradient norm on every
    step, the head's output norm and every layer's update ratio on the sampled steps."""
    grads = recorded(run, "grad_norm")
    for step, layers in seen.grads.items():
        for layer, norm in layers.items():
            value = grads.get((step, layer), math.nan)
            if norm is None:
                assert math.isnan(value), (step, layer, value)
            else:
                assert value == pytest.approx(norm, rel=1e-4, abs=1e-30), (step, layer)
    acts, ratios = recorded(run, "act_norm"), recorded(run, "update_ratio")
    for step in SAMPLED:
        assert acts[(step, "head")] == pytest.approx(seen.acts[step], rel=1e-4), step
        for layer, ratio in seen.ratios[step].items():  # a frozen layer's update is not measured
            if seen.grads[step][layer] is None:
                continue  # no gradient: the layer is not updated
            value = ratios.get((step, layer), math.nan)
            if unoptimized and layer == "head":
                assert math.isnan(value), (step, value)  # no optimizer holds it: its update is not measured
            else:
                assert value == pytest.approx(ratio, rel=1e-3, abs=1e-12), (step, layer)


@pytest.mark.parametrize("kind", list(HEALTHY))
def test_a_healthy_change_is_followed(tmp_path: Path, kind: str) -> None:
    run, seen = watched(HEALTHY[kind], tmp_path / "run")
    assert loud(run) == []
    follows(run, seen)
    result = CliRunner().invoke(cli, ["check", str(tmp_path / "run"), "--format", "json", "--fail-on", "warning"])
    assert result.exit_code == 0, result.output
    json.loads(result.output)


def test_a_new_head_left_out_of_the_optimizer_is_found(tmp_path: Path) -> None:
    """The head replaced, the old optimizer kept (it holds the old head): the new head is truly not optimized."""
    run, seen = watched(Case(replace_head(False)), tmp_path / "run")
    found = loud(run)
    assert [kind for kind, _, _ in found] == ["unoptimized_parameter"]
    assert found[0][2] == "head" and AT <= found[0][1] <= SAMPLED[-1]
    follows(run, seen, unoptimized=True)


def test_a_layer_frozen_on_purpose_keeping_zeroed_gradients_is_not_vanishing(tmp_path: Path) -> None:
    """``zero_grad(set_to_none=False)`` then ``requires_grad_(False)``: exactly zero from then on, frozen."""
    case = Case(frozen_body, set_to_none=False)
    train(case, tmp_path / "run")
    run = gw.open_run(tmp_path / "run")
    assert loud(run) == []
    assert run.layout().trainable == (True, False, False, True, True)
    assert np.isclose(run.metrics("grad_norm", layers=["body"]).set_index("step")["value"].loc[AT:], 0).all()


@pytest.mark.parametrize(("kind", "renewed"), [("replace-head", ["head"]), ("tie-new-optimizer", ["embed", "head"]),
                                               ("load_state_dict-assign", list(LAYERS))])
def test_a_renewed_layer_is_not_judged_against_the_old_ones_history(tmp_path: Path, kind: str,
                                                                    renewed: list[str]) -> None:
    """After 150 steps the head has converged, and its gradients with the loss: a fresh head (or one tied to the
    embedding) has gradients and a loss 40-60x those, which an explosion and a loss spike against the old model's
    history (as before). Its history and the model's restart: the layout says which layers it renewed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = train(HEALTHY[kind], tmp_path / "run", steps=170, at=150)
    assert not [w for w in caught if issubclass(w.category, InternalWarning)]
    bare, _ = train(HEALTHY[kind], None, steps=170, at=150)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))
    run = gw.open_run(tmp_path / "run")
    assert (run.status, run.steps) == ("finished", 170)
    assert loud(run) == []
    layout = run.layout()
    assert [layout.layers[i] for i in layout.renewed] == renewed


def test_unwatch_leaves_no_registration_hook(tmp_path: Path) -> None:
    from torch.nn.modules import module as torch_module

    hooks = (torch_module._global_module_registration_hooks, torch_module._global_parameter_registration_hooks)
    before = [dict(h) for h in hooks]
    model = gw.watch(Net(), run=tmp_path / "run", console=False)
    assert [len(h) for h in hooks] == [len(b) + 1 for b in before]
    gw.unwatch(model)
    assert [dict(h) for h in hooks] == before
