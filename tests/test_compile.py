"""torch.compile: no graph breaks in either order, activation statistics from the compiled graph."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import gradwatch as gw

STEPS = 6  # sample_every=2: three sampled steps, three not


class Net(nn.Module):
    """A small model with a saturating activation, a ReLU and an attention-like softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.mid = nn.Linear(16, 16)
        self.gate = nn.Tanh()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(self.mid(self.act(self.inp(x))))
        return self.out(F.softmax(h, dim=-1) * h)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(STEPS)]


def train(order: str, run: Path) -> nn.Module:
    """Train a fresh Net watched in one of the orders: ``eager``, ``watch-compiled``, ``compile-watched``."""
    torch.manual_seed(0)
    model = Net()
    if order == "watch-compiled":
        called = gw.watch(torch.compile(model), run=run, sample_every=2, console=False)
    elif order == "compile-watched":
        called = torch.compile(gw.watch(model, run=run, sample_every=2, console=False))
    else:
        called = gw.watch(model, run=run, sample_every=2, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(called(x), y)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)
    return model


def series(run: Path, metric: str) -> dict[tuple[int, str], float]:
    frame = gw.open_run(run).metrics(metric, include_global=False)
    return {(int(s), str(layer)): float(v) for s, layer, v in zip(frame.step, frame.layer, frame.value)}


@pytest.mark.slow  # compiles twice
@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_no_graph_breaks_and_the_same_gradient_statistics(tmp_path: Path, order: str) -> None:
    train("eager", tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    train(order, tmp_path / order)
    assert dict(counters["graph_break"]) == {}, f"graph breaks with {order}"
    assert counters["stats"]["unique_graphs"] <= 2, "at most one graph with the activation hooks on, one off"
    for metric in ("grad_norm", "grad_max", "param_norm", "update_ratio"):
        eager, compiled = series(tmp_path / "eager", metric), series(tmp_path / order, metric)
        assert eager.keys() == compiled.keys(), metric
        np.testing.assert_allclose([compiled[k] for k in eager], list(eager.values()), rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # compiles twice
@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_activation_statistics_come_from_the_compiled_graph(tmp_path: Path, order: str) -> None:
    """The leaf hooks are in the graph, switched on for sampled steps, and give what eager hooks give:
    in ``gw.watch(torch.compile(model))`` and in ``torch.compile(gw.watch(model))`` alike (where the root's
    hooks run around the graph and register the leaves' before it is traced).
    """
    train("eager", tmp_path / "eager")
    torch._dynamo.reset()
    train(order, tmp_path / "compiled")
    for metric in ("act_norm", "act_zero_frac", "act_sat_frac"):
        eager, compiled = series(tmp_path / "eager", metric), series(tmp_path / "compiled", metric)
        assert eager, metric
        assert {s for s, _ in eager} == {0, 2, 4}, "sampled steps only"
        assert eager.keys() == compiled.keys(), metric
        np.testing.assert_allclose([compiled[k] for k in eager], list(eager.values()), rtol=1e-4, atol=1e-7)


@pytest.mark.slow  # compiles
def test_a_compiled_model_keeps_no_hook_after_unwatch(tmp_path: Path) -> None:
    torch._dynamo.reset()
    model = train("watch-compiled", tmp_path / "run")
    hooks = [m._forward_hooks for m in model.modules()] + [m._forward_pre_hooks for m in model.modules()]
    assert all(len(h) == 0 for h in hooks)
    assert all(not p._post_accumulate_grad_hooks and not p._backward_hooks for p in model.parameters())


class Broken(nn.Module):
    """A forward that breaks its graph inside a loop (as a ``.item()`` or a print there would): dynamo
    falls back to eager for the whole forward and meets the leaves' calls, hooks and all, as frames of
    their own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 2:
                torch._dynamo.graph_break()
        return self.head(x)


def compile_counts(order: str, run: Path | None) -> tuple[int, int, list[float]]:
    """Train a Broken model compiled in ``order`` (watched into ``run``; or, when None, with a no-op forward
    hook on every leaf, as any hook user has): the graphs, the compiled frames, the losses."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Broken()
    if run is None:
        for module in model.modules():
            if not any(module.children()):
                module.register_forward_hook(lambda module, args, output: None)
        called = torch.compile(model, backend="aot_eager")
    elif order == "watch-compiled":
        called = gw.watch(torch.compile(model, backend="aot_eager"), run=run, sample_every=2, console=False)
    else:
        called = torch.compile(gw.watch(model, run=run, sample_every=2, console=False), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(21):  # more leaf calls than dynamo's recompile limit (8)
        loss = called(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if run is not None:
            gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
    if run is not None:
        gw.unwatch(model)
    return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"], losses


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_a_forward_that_falls_back_to_eager_compiles_no_hook_of_gradwatchs(tmp_path: Path, order: str) -> None:
    """Where a compiled forward falls back to eager, gradwatch's hooks run as plain Python: no graph of a
    hook (guarded on gradwatch's state, compiled again on every leaf call until dynamo's recompile limit
    warned), only what torch compiles for any model with forward hooks; the run is measured as eagerly."""
    logged: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    hooked = compile_counts(order, None)
    handler = Kept(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        watched = compile_counts(order, tmp_path / "run")
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in logged if "recompile" in m], logged
    assert watched[:2] == hooked[:2], "the same graphs and frames as with any forward hook"
    assert watched[2] == hooked[2]
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "finished" and run.steps == 21
        assert not [f for f in run.findings().to_dict("records") if f["severity"] != "info"]
        assert len(run.metrics("act_norm", include_global=False)) > 0  # sampled steps' activations, eagerly
