"""Overhead benchmark, variants: one training loop per way of watching it (bare, gradwatch's settings, references)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from workloads import SEED, Batch, Workload

import gradwatch as gw
from gradwatch import detectors

VARIANTS = ("bare", "gradwatch", "gradwatch_no_origin", "gradwatch_record_only", "gradwatch_stats_only",
            "gradwatch_all", "naive", "anomaly", "foreach", "minimal", "compiled", "gradwatch_compiled")
#: variants measured unless ``--variants`` names them (torch.compile takes a minute per model)
OPT_IN = ("compiled", "gradwatch_compiled")


# ---------------------------------------------------------------- the loop
def _nothing(*args: Any) -> None:
    return None


@dataclass
class Loop:
    """One variant of one workload: its own model copy and optimizer, and an ordinary training loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    on_loss: Callable[[Tensor], None] = _nothing
    on_backward: Callable[[], None] = _nothing
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    after_block: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing
    run_dir: Path | None = None
    done: int = 0
    #: the workload's own training step, if it has one (see ``Workload.train``)
    train: Callable[[Loop, Batch], None] | None = None

    #: CPU seconds (every thread of the process) of the latest :meth:`run`
    cpu: float = 0.0

    def run(self, steps: int) -> float:
        """Train ``steps`` steps; return the elapsed seconds (the CPU seconds are in ``cpu``)."""
        start, cpu = time.perf_counter(), time.process_time()
        with self.context():
            for _ in range(steps):
                self.step()
        self.after_block()
        self.cpu = time.process_time() - cpu
        return time.perf_counter() - start

    def step(self) -> None:
        batch = self.batches[self.done % len(self.batches)]
        self.done += 1
        if self.train is not None:
            self.train(self, batch)
            return
        x, y = batch
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        self.on_loss(loss)
        loss.backward()
        self.on_backward()
        self.optimizer.step()


def make_loop(workload: Workload, batches: list[Batch]) -> Loop:
    torch.manual_seed(SEED)
    model = workload.build()
    return Loop(model, workload.optimizer(model.parameters()), batches, workload.loss, train=workload.train)


# ---------------------------------------------------------------- variants
def with_gradwatch(loop: Loop, run_dir: Path, **options: Any) -> None:
    """Watch the loop's model into ``run_dir``: default rules and options unless ``options`` say otherwise."""
    gw.watch(loop.model, run=run_dir, overwrite=True, **{"rules": "default", "console": False, **options})
    loop.on_loss = lambda loss: gw.watcher(loop.model).observe(loss=loss)
    loop.after_block = lambda: gw.watcher(loop.model).flush()
    loop.close = lambda: gw.unwatch(loop.model)
    loop.run_dir = run_dir


def _first_tensor(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


def with_naive(loop: Loop, run_dir: Path) -> None:
    def grad_hook(grad: Tensor) -> None:
        grad.norm().item()

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        _first_tensor(output).norm().item()

    def remove() -> None:
        for handle in handles:
            handle.remove()

    handles = [p.register_hook(grad_hook) for p in loop.model.parameters()]
    handles += [m.register_forward_hook(forward_hook) for m in loop.model.modules() if not any(m.children())]
    loop.close = remove


def with_anomaly(loop: Loop, run_dir: Path) -> None:
    loop.context = lambda: torch.autograd.set_detect_anomaly(True)


def with_foreach(loop: Loop, run_dir: Path) -> None:
    def read_norms() -> None:
        grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()

    loop.on_backward = read_norms


class Minimal:
    """Reference ``minimal``: the tensor work of gradwatch's default statistics and nothing else.

    Every step: one fused norm over the gradients, read with one host copy. Every
    ``period``-th step (gradwatch's default sampling period) also: the gradients' largest
    values and the weights' norms (one fused call each), a copy of the weights before the
    optimizer step and the norms of the update after it, and each leaf module's output norm and
    non-zero count from forward hooks registered for that step only; all read with one host copy
    after the optimizer step. No detector, no record, no store: what a watcher that takes these
    statistics cannot go below, whatever it does with them.
    """

    def __init__(self, loop: Loop, period: int = 10) -> None:
        self.params = [p for p in loop.model.parameters() if p.requires_grad]
        self.leaves = [m for m in loop.model.modules() if not any(m.children())]
        self.copies = [torch.empty_like(p) for p in self.params]
        self.period, self.step = period, 0
        self.acts: list[Tensor] = []
        self.counts: list[Tensor] = []
        self.parts: list[Tensor] = []
        self.hooks: list[Any] = []
        #: the latest host read (one per step), and how many values each step read
        self.last = torch.empty(0)
        self.sizes: list[int] = []
        self.handles = [loop.optimizer.register_step_pre_hook(self.pre),
                        loop.optimizer.register_step_post_hook(self.post)]
        self.attach()
        loop.close = self.close

    def sampled(self) -> bool:
        return self.step % self.period == 0

    def attach(self) -> None:
        self.hooks = [m.register_forward_hook(self.activation) for m in self.leaves]

    def activation(self, module: nn.Module, args: Any, output: Any) -> None:
        out = _first_tensor(output).detach()
        self.acts.append(torch.linalg.vector_norm(out, dtype=torch.float32))
        self.counts.append(torch.count_nonzero(out))

    def pre(self, *args: Any) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        self.parts = [torch.stack(torch._foreach_norm(grads))]
        if not self.sampled():
            self.read()
            return
        for handle in self.hooks:
            handle.remove()
        self.parts += [torch.stack(torch._foreach_norm(grads, float("inf"))),
                       torch.stack(torch._foreach_norm(self.params))]
        torch._foreach_copy_(self.copies, self.params)

    def post(self, *args: Any) -> None:
        if self.sampled():
            torch._foreach_sub_(self.copies, self.params)
            self.parts += [torch.stack(torch._foreach_norm(self.copies))]
            if self.acts:
                self.parts += [torch.stack(self.acts), torch.stack(self.counts).float()]
            self.read()
            self.acts, self.counts = [], []
        self.step += 1
        if self.sampled():
            self.attach()

    def read(self) -> None:
        self.last = torch.cat(self.parts).cpu()
        self.sizes.append(self.last.numel())

    def close(self) -> None:
        for handle in self.handles + self.hooks:
            handle.remove()


def with_minimal(loop: Loop, run_dir: Path) -> None:
    Minimal(loop)


def with_compile(loop: Loop, run_dir: Path, watched: bool) -> None:
    """``torch.compile`` the model (``gw.watch(torch.compile(model))`` when ``watched``)."""
    model = loop.model
    loop.model = torch.compile(model)
    if watched:
        gw.watch(loop.model, run=run_dir, overwrite=True, rules="default", console=False)
        loop.on_loss = lambda loss: gw.watcher(model).observe(loss=loss)
        loop.after_block = lambda: gw.watcher(model).flush()
        loop.close = lambda: gw.unwatch(model)
        loop.run_dir = run_dir


SETUP: dict[str, Callable[[Loop, Path], None]] = {
    "bare": _nothing,
    "gradwatch": with_gradwatch,
    "gradwatch_no_origin": lambda loop, run_dir: with_gradwatch(loop, run_dir, origin=False),
    "gradwatch_record_only": lambda loop, run_dir: with_gradwatch(loop, run_dir, rules=None),
    "gradwatch_stats_only": lambda loop, run_dir: with_gradwatch(
        loop, run_dir, rules=None, origin=False, detectors={kind: {"enabled": False} for kind in detectors.REGISTRY}),
    "gradwatch_all": lambda loop, run_dir: with_gradwatch(loop, run_dir, sample_every=1),
    "naive": with_naive,
    "anomaly": with_anomaly,
    "foreach": with_foreach,
    "minimal": with_minimal,
    "compiled": lambda loop, run_dir: with_compile(loop, run_dir, watched=False),
    "gradwatch_compiled": lambda loop, run_dir: with_compile(loop, run_dir, watched=True),
}
