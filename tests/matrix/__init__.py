"""The compatibility matrix: "any PyTorch model" as an enumerated space of small trainings.

Each :class:`Cell` is one small, seeded training written the way people write it, in one corner of the
space PRODUCT.md promises (a dtype, a layout, an autograd API, a training style, a number at the edge
of its dtype, a structured output, a run path). The harness runs a cell three times — unwatched,
watched, and watched with a NaN planted at one step — and reads what a user reads:

* training is bit-identical to the unwatched run (no rule acted on a healthy run);
* no :class:`gradwatch.InternalWarning` nor any warning from gradwatch's own code, the run ``finished``
  with every step recorded, and ``gradwatch check RUN --format json --fail-on warning`` passes with JSON
  that parses;
* every per-layer ``grad_norm``, ``param_norm``, ``update_ratio`` and ``act_norm`` the run recorded equals
  the same quantity computed here in float64 from the model as it trains (:class:`Reference`: small
  relative error, never 0 for non-zero values, never inf for finite ones, no measured layer missing);
* the planted NaN is found as ``nonfinite`` at its step, and the run still reads ``finished``.

The cells live in the modules of this package, one per axis of the space (:data:`AXES`); the test
module ``tests/test_matrix.py`` parametrizes over all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gradwatch as gw

#: observe(**scalars) of the watched model, or nothing for an unwatched run
Observe = Callable[..., None]


@dataclass
class Loop:
    """One training, built fresh and seeded: the module watched, one iteration, and its optimizers.

    ``step(i, poison, observe)`` runs iteration ``i`` (one optimizer step, or one update by hand);
    with ``poison`` it puts a NaN where a real one comes from (the batch, by default) in that
    iteration.
    """

    model: nn.Module
    step: Callable[[int, bool, Observe], None]


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: an id ``axis/case``, how to build its loop, and what it promises.

    Attributes:
        id: ``axis/case``, the test id.
        build: a fresh seeded :class:`Loop`.
        steps: iterations run.
        plant: the step at which a NaN is planted (None: this loop has no plant of its own).
        reference: compare the recorded gradient norms with float64 ones read at each optimizer step
            that updates the model (a loop of one optimizer step per iteration).
        tolerance: the largest relative error allowed against the float64 reference.
        slow: the cell takes more than about two seconds here.
        options: ``gw.watch`` options beyond the run directory.
        run_name: the run directory's name under the test's temporary folder.
    """

    id: str
    build: Callable[[], Loop]
    steps: int = 24
    plant: int | None = 12
    reference: bool = True
    tolerance: float = 1e-3
    slow: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    run_name: str = "run"


@dataclass
class Outcome:
    """What one run of a cell left: its final weights, the reference norms, the warnings it raised."""

    weights: list[torch.Tensor]
    reference: dict[str, dict[int, dict[str, float]]]
    warnings: list[warnings.WarningMessage]
    run: Path | None


#: the layer name gradwatch gives the root module (its own parameters, or a model that is one leaf)
ROOT = "(root)"


def _dense(t: torch.Tensor) -> torch.Tensor:
    return (t.to_dense() if t.layout != torch.strided else t).detach()


def norm64(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of several tensors together (complex ones: of their magnitudes), in float64 with
    scaling: no under- or overflow wherever the norm itself is a float64."""
    if not tensors:
        return math.nan
    mags = [_dense(t).abs().to(torch.float64).reshape(-1) for t in tensors]
    top = max(float(m.max()) if m.numel() else 0.0 for m in mags)
    if top == 0.0 or not math.isfinite(top):
        return top
    return top * math.sqrt(sum(float(((m / top) ** 2).sum()) for m in mags))


def owners(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each module that owns parameters directly, by path: its own parameters."""
    out = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            out[name or ROOT] = own
    return out


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The strided tensors inside an output: a tensor, a tuple, list or dict of them, a dataclass."""
    if isinstance(value, torch.Tensor):
        return [value] if value.layout == torch.strided and not value.is_nested else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


class Reference:
    """The statistics gradwatch should record, computed here in float64 from the model as it trains.

    At each optimizer step that updates the model (its pre-hook): each owning module's gradient norm
    and weight norm; at its post-hook, the update ratio ``||w_after - w_before|| / ||w_before||``; at
    each train-mode forward call of a leaf module outside a backward pass and outside a ``torch.func``
    transform, its output's squared norm, summed into the step that call belongs to (the next one).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values: dict[str, dict[int, dict[str, float]]] = {
            "grad_norm": {}, "param_norm": {}, "update_ratio": {}, "act_norm": {}}
        self._squares: dict[int, dict[str, float]] = {}
        self._before: dict[str, list[torch.Tensor]] = {}
        self._steps = 0
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        self._handles += [m.register_forward_hook(self._forward(name or ROOT)) for name, m in model.named_modules()
                          if not list(m.children())]

    def _mine(self, optimizer: Any) -> bool:
        mine = {id(p) for p in self.model.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._mine(optimizer):
            return
        layers = owners(self.model)
        grads = {n: [p.grad for p in ps if p.grad is not None] for n, ps in layers.items()}
        self.values["grad_norm"][self._steps] = {n: norm64(g) for n, g in grads.items() if g}
        self.values["param_norm"][self._steps] = {n: norm64(list(ps)) for n, ps in layers.items()}
        self._before = {n: [_dense(p).clone() for p in ps] for n, ps in layers.items()}

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._mine(optimizer):
            return
        ratios = {}
        for name, ps in owners(self.model).items():
            before = self._before.get(name)
            if before is not None and len(before) == len(ps):
                weight = norm64(before)
                if weight > 0:
                    ratios[name] = norm64([_dense(p) - b for p, b in zip(ps, before)]) / weight
        self.values["update_ratio"][self._steps] = ratios
        squares = self._squares.pop(self._steps, {})
        self.values["act_norm"][self._steps] = {n: math.sqrt(v) for n, v in squares.items()}
        self._steps += 1

    def _forward(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not module.training or torch._C._current_graph_task_id() != -1:
                return
            if torch._C._functorch.peek_interpreter_stack() is not None:
                return
            outs = tensors_in(output)
            if outs:
                into = self._squares.setdefault(self._steps, {})
                into[name] = into.get(name, 0.0) + norm64(outs) ** 2
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def observer(model: nn.Module, watched: bool) -> Observe:
    if not watched:
        return lambda **scalars: None
    return gw.watcher(model).observe


def weights_of(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer, dense (a sparse adjacency buffer compares as its values)."""
    return [(t.to_dense() if t.layout != torch.strided else t).detach().clone()
            for t in [*model.parameters(), *model.buffers()]]


def train(cell: Cell, run: Path | None, plant: int | None = None) -> Outcome:
    """Run ``cell`` once: unwatched (``run`` None) or watched into ``run``, with a NaN at ``plant``."""
    torch.manual_seed(0)
    loop = cell.build()
    reference = Reference(loop.model) if cell.reference else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if run is not None:
            gw.watch(loop.model, run=run, overwrite=True, console=False, **cell.options)
        observe = observer(loop.model, run is not None)
        for i in range(cell.steps):
            loop.step(i, i == plant, observe)
        if run is not None:
            gw.watcher(loop.model).close()
            gw.unwatch(loop.model)
    if reference is not None:
        reference.remove()
    return Outcome(weights_of(loop.model), reference.values if reference else {}, list(caught), run)


#: gradwatch's own source folder: a warning raised from a line there is gradwatch's (torch's, from its ops)
_SOURCE = str(Path(gw.__file__).resolve().parent)


def internal_warnings(outcome: Outcome) -> list[str]:
    """The run's :class:`gradwatch.InternalWarning` s, and any warning torch raised from gradwatch's own code
    (a cast that drops a complex value's imaginary part, say): none is the user's to read."""
    return [f"{w.category.__name__}: {w.message}" for w in outcome.warnings
            if issubclass(w.category, gw.InternalWarning) or str(Path(w.filename).resolve()).startswith(_SOURCE)]


def check(run: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """``gradwatch check RUN --format json`` in this process: its exit status and its parsed report."""
    from gradwatch.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", str(run), "--format", "json", *options])
    return code, json.loads(out.getvalue())


def recorded(run: Path, metric: str) -> dict[tuple[int, str], float]:
    """``(step, layer) -> value`` of one per-layer metric the run recorded."""
    with gw.open_run(run) as opened:
        frame = opened.metrics()
    frame = frame[(frame.metric == metric) & frame.layer.notna()]
    return {(int(s), str(layer)): float(v) for s, layer, v in zip(frame.step, frame.layer, frame.value)}


#: the metrics compared with the reference, and how far below a layer's typical value a reference value may
#: be and still be compared (an update ratio of a weight that did not move is 0 in both)
COMPARED = ("grad_norm", "param_norm", "update_ratio", "act_norm")


def compare(run: Path, reference: dict[str, dict[int, dict[str, float]]], tolerance: float) -> list[str]:
    """The recorded statistics that disagree with the float64 reference (messages); none compared is one."""
    wrong = []
    seen = 0
    for metric in COMPARED:
        want_by_step = reference.get(metric, {})
        got = recorded(run, metric)
        for step in sorted({s for s, _ in got}):
            missing = sorted(set(want_by_step.get(step, {})) - {layer for s, layer in got if s == step})
            if missing and metric in ("grad_norm", "act_norm"):
                wrong.append(f"{metric} at step {step}: no value for {missing}")
        for (step, layer), value in got.items():
            want = want_by_step.get(step, {}).get(layer)
            if want is None or not math.isfinite(want):
                continue
            seen += 1
            where = f"{metric} at step {step} of {layer!r}"
            if want > 0 and value == 0:
                wrong.append(f"{where}: recorded 0 for {want:.3g}")
            elif not math.isfinite(value):
                wrong.append(f"{where}: recorded {value} for a finite {want:.3g}")
            elif abs(value - want) > tolerance * abs(want):
                wrong.append(f"{where}: recorded {value:.6g}, float64 gives {want:.6g}")
    if not seen:
        wrong.append("no recorded statistic matched a layer and step of the reference")
    return wrong


def findings(run: Path) -> list[dict[str, Any]]:
    with gw.open_run(run) as opened:
        frame = opened.findings()
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in frame.to_dict("records")]


def status(run: Path) -> tuple[str, int]:
    with gw.open_run(run) as opened:
        return opened.status, opened.steps
