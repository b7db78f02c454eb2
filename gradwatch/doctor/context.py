"""Doctor context: the copied model and batch, and the probe run the checks read (gradients, activations, calls)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import Function

from gradwatch.doctor.results import RELU_FAMILY, DoctorOptions, LossFn
from gradwatch.doctor.target import _map_tensors, _one_line, compute_loss
from gradwatch.errors import ConfigError
from gradwatch.step.layout import bounds
from gradwatch.step.origin import tensors
from gradwatch.store.records import ROOT
from gradwatch.watching.parametrized import computing, is_leaf, own_parameters


# ----------------------------------------------------------------------------------------------- the context
@dataclass
class _Saved:
    """A tensor argument of a custom Function call, copied at the call."""

    tensor: torch.Tensor
    requires_grad: bool


@dataclass
class _Call:
    """The first call of a custom ``autograd.Function`` in the probe's forward."""

    cls: type[Function]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _Activation:
    """Activation statistics of one leaf module over the probe's forward."""

    type: str
    units: int = 0
    dead: int = 0
    elements: int = 0
    saturated: int = 0


@dataclass
class Probe:
    """One forward/backward on a copy of the model, with everything the checks read from it.

    Attributes:
        loss: the loss value.
        requires_grad: whether the loss depends on anything that requires a gradient.
        trainable: names of the parameters that require a gradient, in model order.
        frozen: names of the parameters that do not.
        grads: gradient of each trainable parameter (None: it received none).
        layers: modules owning trainable parameters directly, in model order, with their parameter names.
        types: class name of every module.
        activations: per leaf module that ran.
        first_nonfinite: the first module whose forward returned a non-finite output, and whether its
            inputs were finite.
        calls: first call of every custom autograd Function reached, in call order.
    """

    loss: float
    requires_grad: bool
    trainable: list[str]
    frozen: list[str]
    grads: dict[str, torch.Tensor | None]
    layers: list[tuple[str, list[str]]]
    types: dict[str, str]
    activations: dict[str, _Activation]
    first_nonfinite: tuple[str, bool] | None
    calls: list[_Call]


@dataclass
class _Context:
    """What every check needs: the inputs, the options, and the shared probe."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn | None
    options: DoctorOptions
    device: torch.device | None
    batch_device: torch.device
    _probe: Probe | Exception | None = None

    def fresh_model(self) -> nn.Module:
        """A deep copy of the model, gradients cleared, on the chosen device."""
        try:
            clone = copy.deepcopy(self.model)
        except Exception as exc:
            raise RuntimeError(f"cannot deepcopy the model ({_one_line(exc)}); the doctor never runs the "
                               "original") from None
        clone.zero_grad(set_to_none=True)
        return clone.to(self.device) if self.device is not None else clone

    def fresh_batch(self) -> Any:
        """A copy of the batch on the device, each tensor keeping its ``requires_grad``."""

        def copy_tensor(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().clone().to(self.batch_device)
            return out.requires_grad_(True) if t.requires_grad else out

        return _map_tensors(self.batch, copy_tensor)

    def probe(self) -> Probe:
        """The shared forward/backward, run once (an error it raised is raised again to every check)."""
        if self._probe is None:
            try:
                self._probe = _run_probe(self)
            except Exception as exc:
                self._probe = exc
        if isinstance(self._probe, Exception):
            raise self._probe
        return self._probe


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> tuple[torch.device | None, torch.device]:
    """(device to move the copies to or None, device of the batch)."""
    if device is None:
        first: torch.Tensor | None = next(model.parameters(), None)
        if first is None:
            first = next(model.buffers(), None)
        return None, first.device if first is not None else torch.device("cpu")
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:
        raise ConfigError(f"device {str(device)!r} cannot be used: {_one_line(exc)}") from None
    return dev, dev


@contextmanager
def _rng_restored(device: torch.device) -> Iterator[None]:
    """Fork torch's (CPU and initialised CUDA), Python's and NumPy's random states; restore them on exit."""
    if device.type == "cuda":
        torch.cuda.init()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


# ------------------------------------------------------------------------------------------------- the probe
def _run_probe(ctx: _Context) -> Probe:
    model = ctx.fresh_model()
    batch = ctx.fresh_batch()
    types = {name or ROOT: type(m).__name__ for name, m in model.named_modules()}
    recorder = _ActivationRecorder(model, types)
    with recorder, _FunctionRecorder() as functions:
        loss = compute_loss(model, batch, ctx.loss_fn)
    if loss.requires_grad:
        loss.backward()
    named = list(model.named_parameters())
    trainable = [n for n, p in named if p.requires_grad]
    canonical = {id(p): n for n, p in named}  # a tied parameter has one name, and counts in each owner
    layers = []
    inside = computing(model)  # a parametrized module's originals are its own; the modules computing them no layers
    for name, module in model.named_modules():
        owned = [canonical[id(p)] for p in own_parameters(module) if p.requires_grad and id(module) not in inside]
        if owned:
            layers.append((name or ROOT, owned))
    return Probe(
        loss=float(loss.detach()), requires_grad=loss.requires_grad, trainable=trainable,
        frozen=[n for n, p in named if not p.requires_grad],
        grads={n: (p.grad.detach() if p.grad is not None else None) for n, p in named if p.requires_grad},
        layers=layers, types=types, activations=recorder.stats, first_nonfinite=recorder.first_nonfinite,
        calls=functions.calls,
    )


class _ActivationRecorder:
    """Forward hooks: dead units and saturated outputs of the leaf modules, and the first module.

    The first module is the first (any module, in the order their forwards finish) whose output
    is not finite.
    """

    def __init__(self, model: nn.Module, types: dict[str, str]) -> None:
        inside = computing(model)  # a parametrization's output is its module's weight: named after that module
        self.modules = [((inside[id(m)][0] if id(m) in inside else name) or ROOT, m, is_leaf(m, inside))
                        for name, m in model.named_modules()]
        self.types = types
        self.stats: dict[str, _Activation] = {}
        self.first_nonfinite: tuple[str, bool] | None = None  # (module, whether its inputs were finite)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _ActivationRecorder:
        for name, module, leaf in self.modules:
            self._handles.append(module.register_forward_hook(self._hook(name, leaf), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str, leaf: bool) -> Callable[[nn.Module, Any, Any, Any], None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            with torch.no_grad():
                if self.first_nonfinite is None and not _finite(output):
                    self.first_nonfinite = (name, _finite(args) and _finite(kwargs))
                if leaf:
                    self._observe(name, module, output)

        return hook

    def _observe(self, name: str, module: nn.Module, output: Any) -> None:
        stats = self.stats.setdefault(name, _Activation(type=self.types[name]))
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        out = output.detach()
        if isinstance(module, RELU_FAMILY):
            if out.dim() >= 2 and out.shape[0] >= 2:
                alive = (out != 0).any(dim=0)
                stats.units += alive.numel()
                stats.dead += int(alive.numel() - int(alive.sum()))
            return
        limits = bounds(module)
        if limits is not None and out.numel():
            lo, hi = limits
            margin = 0.01 * (hi - lo)
            stats.elements += out.numel()
            stats.saturated += int(((out <= lo + margin) | (out >= hi - margin)).sum())


def _finite(value: Any) -> bool:
    """Whether every floating tensor in a (nested) tuple, list or mapping is finite."""
    return all(bool(torch.isfinite(t).all()) for t in tensors(value) if t.is_floating_point())


def _is_torch_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "functorch")


class _FunctionRecorder:
    """Records the first call of every custom ``autograd.Function`` while active.

    The ``forward`` of every subclass defined outside torch is wrapped (and restored on exit), so
    calls through ``MyFn.apply`` and through a saved ``my_fn = MyFn.apply`` are both seen.
    """

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._seen: set[type[Function]] = set()
        self._patched: list[tuple[type[Function], object]] = []

    def __enter__(self) -> _FunctionRecorder:
        base_forward = Function.forward
        classes = [c for c in _subclasses(Function) if not _is_torch_class(c)]
        originals = [(c, c.__dict__.get("forward"), c.forward) for c in classes if c.forward is not base_forward]
        for cls, entry, forward in originals:
            self._patched.append((cls, entry))
            cls.forward = staticmethod(self._wrap(cls, forward))  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, entry in reversed(self._patched):
            if entry is None:
                delattr(cls, "forward")
            else:
                cls.forward = entry  # type: ignore[method-assign,assignment]
        self._patched.clear()

    def _wrap(self, cls: type[Function], forward: Callable[..., Any]) -> Callable[..., Any]:
        takes_ctx = cls.setup_context is Function.setup_context

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            if cls not in self._seen:
                self._seen.add(cls)
                inputs = args[1:] if takes_ctx else args
                self.calls.append(_Call(cls, tuple(_save(a) for a in inputs), {k: _save(v) for k, v in kwargs.items()}))
            return forward(*args, **kwargs)

        return recording_forward


def _subclasses(cls: type[Function]) -> list[type[Function]]:
    found: list[type[Function]] = []
    stack: list[type[Function]] = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in found:
            found.append(sub)
            stack.extend(sub.__subclasses__())
    return found


def _save(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Saved(value.detach().clone(), value.requires_grad)
    return value
