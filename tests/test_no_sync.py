"""No hook reads a tensor's value (a device sync): the step's one host read is the only one.

Every way a tensor's value reaches Python (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool``,
``float``, ``int``, ``__array__``, ``__index__``) is counted while one of gradwatch's hooks runs
(forward, backward, activation, the end of backward, the gradient hooks) and while its optimizer
step pre-hook runs. On CPU these reads are cheap, but on an accelerator each one waits for the
device: the hooks must launch work and never read it.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw
from gradwatch.step import iteration, lifecycle, probe

#: the tensor methods through which a value reaches the host
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__")
#: gradwatch's hooks that run inside forward and backward passes
HOOKS = [(probe.Probe, "_forward_pre"), (probe.Probe, "_forward_post"), (probe.Probe, "_output_grad"),
         (probe.Probe, "_sentinel_grad"), (probe.Probe, "_activation"), (iteration.Iteration, "backward_done"),
         (iteration.Iteration, "backward_ended")]


class Reads:
    """Counts the tensor reads made inside gradwatch's hooks and inside its optimizer step pre-hook."""

    def __init__(self) -> None:
        self.where: str | None = None
        self.hooks: Counter[str] = Counter()
        self.step: Counter[str] = Counter()

    def count(self, name: str) -> None:
        if self.where == "hook":
            self.hooks[name] += 1
        elif self.where == "step":
            self.step[name] += 1


@contextlib.contextmanager
def counted() -> Iterator[Reads]:
    """Patch the tensor read methods and gradwatch's hooks (before ``gw.watch``: hooks bind then)."""
    reads = Reads()
    saved: list[tuple[type, str, Any]] = []

    def patch(cls: type, name: str, make: Callable[[Any], Any]) -> None:
        saved.append((cls, name, cls.__dict__.get(name)))  # None: inherited
        setattr(cls, name, make(getattr(cls, name)))

    def reader(name: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            @functools.wraps(original)
            def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                reads.count(name)
                return original(self, *args, **kwargs)
            return read
        return make

    def inside(where: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            @functools.wraps(original)
            def run(*args: Any, **kwargs: Any) -> Any:
                outer, reads.where = reads.where, reads.where or where
                try:
                    return original(*args, **kwargs)
                finally:
                    reads.where = outer
            return run
        return make

    for name in READS:
        patch(torch.Tensor, name, reader(name))
    for cls, name in HOOKS:
        patch(cls, name, inside("hook"))
    patch(lifecycle.Lifecycle, "step_pre", inside("step"))
    try:
        yield reads
    finally:
        for cls, name, original in reversed(saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train(model: nn.Module, steps: int, *, clip: bool = False, accumulate: int = 1, late: bool = False) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if not late:
                gw.watcher(model).observe(loss=loss)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        if late:  # observed after the step: read with the next step's host read
            gw.watcher(model).observe(loss=loss)


@pytest.mark.parametrize("loop", ["plain", "clipped", "accumulated", "observed_after_step"])
def test_hooks_never_read_a_tensor_and_each_step_reads_once(run_dir: Path, loop: str) -> None:
    with counted() as reads:
        model = Net()
        gw.watch(model, run=run_dir, sample_every=5, console=False)  # rules and origin tracking at their defaults
        kinds = {"clip": loop == "clipped", "accumulate": 2 if loop == "accumulated" else 1,
                 "late": loop == "observed_after_step"}
        train(model, 3, **kinds)  # warm-up
        reads.hooks.clear()
        reads.step.clear()
        steps = 7  # steps 3..9: one of them (5) sampled
        train(model, steps, **kinds)
        gw.unwatch(model)
    assert reads.hooks == Counter(), f"gradwatch's hooks read tensors: {dict(reads.hooks)}"
    assert reads.step == Counter({"cpu": steps, "numpy": steps}), (
        f"each step reads its statistics in one host copy; got {dict(reads.step)} over {steps} steps")
    assert not gw.open_run(run_dir).findings().severity.isin(["warning", "error"]).any()


def test_the_counter_sees_a_read_in_a_hook(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above would see a hook that reads: one planted where the forward hook calls is counted."""
    original = iteration.Iteration.forward_started

    def reading(self: iteration.Iteration, *args: Any) -> None:
        if float(torch.ones(()).sum()) > 0:  # a read of a (tiny) tensor, as a careless hook would
            original(self, *args)

    monkeypatch.setattr(iteration.Iteration, "forward_started", reading)
    with counted() as reads:
        model = Net()
        gw.watch(model, run=run_dir, console=False)
        train(model, 2)
        gw.unwatch(model)
    assert reads.hooks == Counter({"__float__": 2})
