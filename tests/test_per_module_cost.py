"""A step that takes no activation statistics costs the same Python work whatever the number of modules.

Counted, never timed: on an unsampled step of a deep stack of tiny residual blocks (163, 403 and
1,003 modules), the calls torch makes into gradwatch (by hook kind, through the guard's counter),
the calls of gradwatch's Python functions and of the C functions they call, in the training thread
(``sys.setprofile``), and the Python objects the step leaves alive (the flight recorder is full: a
record in, a record out) must not grow with the module count.
"""

from __future__ import annotations

import collections
import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.step import aggregate
from gradwatch.watching import guard

pytestmark = pytest.mark.slow  # three models trained 49 steps each, up to 1,003 modules: seconds

PACKAGE = str(Path(gw.__file__).resolve().parent)
#: blocks of each model: 4 modules each (the block, LayerNorm, Linear, ReLU), and the root, a norm and the head
SIZES = (40, 100, 250)
#: steps trained before the counted one: past two sampled steps (0 and 10) and the flight recorder's
#: 32 records, so that the counted step (45) is neither sampled nor just after a sampled one
WARMUP = 45


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.act = nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU()
        nn.init.normal_(self.fc.weight, std=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x)))


def stack(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Tiny() for _ in range(blocks)), nn.LayerNorm(8), nn.Linear(8, 1))


class Loop:
    """A watched model and its optimizer, one ordinary step at a time."""

    def __init__(self, blocks: int, run: Path) -> None:
        self.model = stack(blocks)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        self.batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(4)]
        gw.watch(self.model, run=run, console=False)
        self.watcher = gw.watcher(self.model)
        self.done = 0

    def step(self) -> None:
        x, y = self.batches[self.done % len(self.batches)]
        self.done += 1
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        self.watcher.observe(loss=loss)
        loss.backward()
        self.opt.step()


def profiled(step: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Run ``step`` under ``sys.setprofile``: the calls of each gradwatch function, and of each C function
    called from a gradwatch frame (by name), in this thread.
    """
    calls: collections.Counter[str] = collections.Counter()
    c_calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if event == "call":
            calls[f"{frame.f_code.co_filename[len(PACKAGE):]}:{frame.f_code.co_qualname}"] += 1
        elif event == "c_call":
            c_calls[getattr(arg, "__qualname__", repr(arg))] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return dict(calls), dict(c_calls)


def alive() -> int:
    """The objects the garbage collector tracks, weak references aside."""
    return sum(1 for o in gc.get_objects() if type(o) is not weakref.ReferenceType)


def counted(blocks: int, run: Path) -> dict[str, Any]:
    """What one unsampled step of a model of ``blocks`` blocks costs, counted."""
    loop = Loop(blocks, run)
    try:
        for _ in range(WARMUP):
            loop.step()
        with guard.inject(None) as entered:
            calls, c_calls = profiled(loop.step)
            hooks = dict(entered)
        # the objects a step leaves alive, over a few steps (the flight recorder is full: one record
        # in, one out), collections aside; weak references are not counted: sqlite3 keeps one per
        # cursor of the writer thread's, pruned every 200 cursors, and how many cursors the writer
        # makes depends on how it batches the steps
        loop.watcher.flush()  # the writer thread's work done (it allocates too)
        gc.collect()
        gc.disable()
        try:
            before = alive()
            for _ in range(3):
                loop.step()
            loop.watcher.flush()
            retained = alive() - before
        finally:
            gc.enable()
        return {"hooks": hooks, "calls": calls, "c_calls": c_calls, "retained": retained,
                "modules": sum(1 for _ in loop.model.modules())}
    finally:
        gw.unwatch(loop.model)


def measured(root: Path) -> dict[int, dict[str, Any]]:
    """Every size counted, one thread for torch."""
    torch.set_num_threads(1)
    # the per-layer sums are a matrix-vector product up to a size, then a scatter (both one numpy
    # call per step): every model here takes the scatter, so that the counts compare like with like
    aggregate.DENSE = 0
    return {blocks: counted(blocks, root / f"run{blocks}") for blocks in SIZES}


@pytest.fixture(scope="module")
def costs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Counted in a process of its own: the objects alive are those of every thread, and a thread an
    earlier test left running (a server, a watcher's writer) allocating during the count would be
    counted as the step's (the CI run's full suite once read one more object at the first size).
    """
    root = tmp_path_factory.mktemp("per-module")
    done = subprocess.run([sys.executable, __file__, str(root)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {int(blocks): cost for blocks, cost in json.loads(done.stdout.splitlines()[-1]).items()}


def test_the_models_differ_in_their_module_count(costs: dict[int, dict[str, Any]]) -> None:
    assert [costs[b]["modules"] for b in SIZES] == [4 * b + 3 for b in SIZES]


def test_the_hook_calls_of_an_unsampled_step_do_not_grow_with_the_modules(costs: dict[int, dict[str, Any]]) -> None:
    small = costs[SIZES[0]]["hooks"]
    # one forward call, one backward pass, one optimizer step: the root's hooks, the sentinel's,
    # the end of the backward pass and the optimizer's, and no activation hook
    assert small == {"forward_pre": 1, "forward": 1, "output_grad": 1, "sentinel_grad": 1, "accumulated": 1,
                     "backward_end": 2, "step_pre": 1, "step_post": 1}
    for blocks in SIZES[1:]:
        assert costs[blocks]["hooks"] == small


def test_the_python_calls_of_an_unsampled_step_do_not_grow_with_the_modules(
        costs: dict[int, dict[str, Any]]) -> None:
    small = costs[SIZES[0]]
    assert small["calls"], "the profile saw no gradwatch frame"
    for blocks in SIZES[1:]:
        big = costs[blocks]
        grown = {k: (small["calls"].get(k, 0), n) for k, n in big["calls"].items() if n > small["calls"].get(k, 0)}
        assert not grown, f"gradwatch functions called more often with {big['modules']} modules: {grown}"
        grown = {k: (small["c_calls"].get(k, 0), n) for k, n in big["c_calls"].items()
                 if n > small["c_calls"].get(k, 0)}
        assert not grown, f"C functions called from gradwatch more often with {big['modules']} modules: {grown}"
        assert sum(big["calls"].values()) == sum(small["calls"].values())


def test_the_objects_an_unsampled_step_leaves_alive_do_not_grow_with_the_modules(
        costs: dict[int, dict[str, Any]]) -> None:
    retained = [costs[b]["retained"] for b in SIZES]
    assert retained[1:] == retained[:1] * (len(SIZES) - 1), retained


if __name__ == "__main__":
    print(json.dumps(measured(Path(sys.argv[1]))))
