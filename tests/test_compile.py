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


class Expert(nn.Module):
    """One expert of a switch mixture: its tanh is a bounded leaf (a saturated count)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SwitchMoE(nn.Module):
    """Top-1 routing over ten experts, called one by one from a Python loop that skips an expert no token
    chose (a data-dependent graph break in a loop): dynamo runs this forward eagerly and compiles
    ``Expert.forward`` as a frame of its own, one code for all ten experts, their leaves' hooks traced in it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 10)
        self.experts = nn.ModuleList(Expert() for _ in range(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, idx = F.softmax(self.router(x), -1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = torch.where(idx == e)[0]
            if chosen.numel() == 0:
                continue
            out = out.index_add(0, chosen, expert(x[chosen]) * gate[chosen, None])
        return out


def train_moe(order: str, run: Path | None, *, backend: str = "aot_eager", sample_every: int = 2,
              steps: int = 10) -> tuple[dict[str, int], list[float]]:
    """Train a SwitchMoE in ``order`` (``eager``, ``watch-compiled``, ``compile-watched``; with ``run`` None:
    compiled unwatched, ``hooked``: compiled with a no-op forward hook on every leaf): what dynamo compiled
    (graphs, frames, versions of ``Expert.forward``, graph breaks) and the losses."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = SwitchMoE()
    options = {"run": run, "sample_every": sample_every, "console": False}
    if order == "hooked":
        for module in model.modules():
            if not any(module.children()):
                module.register_forward_hook(lambda module, args, output: None)
    if run is None:
        called = torch.compile(model, backend=backend)
    elif order == "watch-compiled":
        called = gw.watch(torch.compile(model, backend=backend), **options)
    elif order == "compile-watched":
        called = torch.compile(gw.watch(model, **options), backend=backend)
    else:
        called = gw.watch(model, **options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(48, 16, generator=gen)
        loss = (called(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if run is not None:
            gw.watcher(model).observe(loss=loss)
        opt.step()
        losses.append(loss.item())
    if run is not None:
        gw.unwatch(model)
    versions = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(Expert.forward.__code__)
    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
            "expert versions": len(versions), "graph breaks": sum(counters["graph_break"].values())}, losses


@pytest.mark.slow  # compiles four times
@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_a_mixture_of_experts_compiles_each_experts_forward_once_for_all_its_instances(
        tmp_path: Path, order: str) -> None:
    """The leaf hooks traced into a frame that each expert calls in turn are guarded on nothing that differs
    from one expert to the next (they were on their layer's index and a list growing with each call: every
    expert compiled ``Expert.forward`` anew until dynamo's recompile limit warned, and the rest ran
    eagerly): what dynamo compiles is what any forward hook costs, the activation statistics of every
    expert a token chose come from the graph and are those of eager mode, the losses those unwatched."""
    logged: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    hooked, unwatched = train_moe("hooked", None, sample_every=1)
    handler = Kept(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        # every step sampled: the leaf hooks are on throughout, as the no-op hooks
        every, losses_every = train_moe(order, tmp_path / "every", sample_every=1)
        # every other step: the hooks switched off in between, a second version of each frame
        other, losses_other = train_moe(order, tmp_path / "other", sample_every=2)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in logged if "recompile" in m], logged
    assert hooked["expert versions"] >= 2, "Expert.forward is a frame of its own (its first shape, then dynamic)"
    assert all(every[k] <= hooked[k] for k in hooked), (every, hooked)  # what any forward hook on every leaf costs
    assert every["graphs"] == hooked["graphs"] and every["expert versions"] == hooked["expert versions"]
    assert other["expert versions"] <= 2 * hooked["expert versions"], "one more version for the hooks off"
    assert other["graphs"] <= 2 * hooked["graphs"] and other["graph breaks"] == hooked["graph breaks"]
    assert losses_every == losses_other == unwatched
    _, eager_losses = train_moe("eager", tmp_path / "eager", sample_every=2)
    assert eager_losses == unwatched  # aot_eager computes what eager mode does, bit for bit
    for metric in ("act_norm", "act_zero_frac", "act_sat_frac"):
        eager, compiled = series(tmp_path / "eager", metric), series(tmp_path / "other", metric)
        assert {s for s, _ in eager} == {0, 2, 4, 6, 8}, "sampled steps only"
        assert eager.keys() == compiled.keys(), metric
        np.testing.assert_allclose([compiled[k] for k in eager], list(eager.values()), rtol=1e-5, atol=1e-7)
    chosen = {layer for _, layer in series(tmp_path / "other", "act_norm")}
    assert {f"experts.{e}.{leaf}" for e in range(10) for leaf in ("fc1", "act", "fc2")} <= chosen


@pytest.mark.slow  # compiles with inductor
@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_a_compiled_mixture_of_experts_gives_the_losses_it_gives_with_any_forward_hook(
        tmp_path: Path, order: str) -> None:
    """Compiled by inductor, whose kernels round differently from eager mode's: the watched mixture's losses
    are those of the unwatched compiled one with a no-op forward hook on every leaf, bit for bit (were not
    from the experts that ran eagerly past dynamo's recompile limit on). Any forward hook has dynamo
    compile a leaf that a forward run eagerly calls (here the router), which a model without hooks runs
    eagerly: that may round differently, on another CPU, from the model without any hook."""
    _, hooked = train_moe("hooked", None, backend="inductor")
    _, watched = train_moe(order, tmp_path / "run", backend="inductor")
    assert watched == hooked


@pytest.mark.parametrize("order", ["watch-compiled", "compile-watched"])
def test_many_forward_calls_per_step_compile_one_graph_for_all_of_them(tmp_path: Path, order: str) -> None:
    """A rollout's twelve forward calls per step: the graph with the leaf hooks on is guarded on nothing that
    grows with each call (it was on the length of a list of the step's calls: every call compiled anew until
    dynamo's recompile limit warned); the activation statistics sum the calls as eager mode's do."""
    logged: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    def rollout(order: str, run: Path) -> None:
        torch.manual_seed(0)
        model = Net()
        options = {"run": run, "sample_every": 2, "console": False}
        if order == "watch-compiled":
            called = gw.watch(torch.compile(model, backend="aot_eager"), **options)
        elif order == "compile-watched":
            called = torch.compile(gw.watch(model, **options), backend="aot_eager")
        else:
            called = gw.watch(model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            loss = sum(called(torch.randn(4, 8, generator=gen)).pow(2).mean() for _ in range(12))
            opt.zero_grad()
            loss.backward()
            opt.step()
        gw.unwatch(model)

    rollout("eager", tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    handler = Kept(logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        rollout(order, tmp_path / "compiled")
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in logged if "recompile" in m], logged
    # the hooks on for the step's first call, on with its leaves' sums begun, off
    assert counters["stats"]["unique_graphs"] <= 3
    for metric in ("act_norm", "act_zero_frac", "act_sat_frac"):
        eager, compiled = series(tmp_path / "eager", metric), series(tmp_path / "compiled", metric)
        assert {s for s, _ in eager} == {0, 2}, metric
        assert eager.keys() == compiled.keys(), metric
        np.testing.assert_allclose([compiled[k] for k in eager], list(eager.values()), rtol=1e-5, atol=1e-7)
