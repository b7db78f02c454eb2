"""Doctor: pre-flight checks on a model and one batch, in seconds, before a long training run.

``diagnose(model, batch, loss_fn)`` runs six checks and returns one :class:`CheckResult` each:

- ``gradient_path``: one forward/backward; trainable parameters that get no gradient, frozen ones.
- ``train_mode``: the model, or some of its submodules, left in eval mode.
- ``gradient_flow``: per-layer gradient norms at initialisation: non-finite, vanishing, exploding.
- ``activations``: dead ReLU units, saturated sigmoid/tanh outputs, the first non-finite output.
- ``overfit_batch``: Adam on the one batch must drive the loss down to a fraction of its start.
- ``autograd_functions``: ``torch.autograd.gradcheck`` of every custom ``autograd.Function`` reached.

The contract of ``(model, batch, loss_fn)`` (also what a ``gradwatch doctor`` factory returns):

- with a ``loss_fn``, ``batch`` is a pair ``(inputs, targets)`` and the loss is
  ``loss_fn(model(inputs), targets)``; ``batch`` may also be a lone tensor or dict of inputs, and
  then the loss is ``loss_fn(model(inputs))``;
- with ``loss_fn=None`` the whole batch is the inputs, and the model's output must be the loss
  itself (a scalar tensor) or carry it as ``.loss`` / ``["loss"]`` (Hugging Face style);
- inputs that are a tensor are passed as ``model(x)``, a tuple or list as ``model(*inputs)``, a
  dict (any mapping) as ``model(**inputs)``.

The user's model is never modified: every check works on a deep copy, the random number
generators (torch, Python, NumPy) are seeded for the checks and restored afterwards.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import Function
from torch.autograd.gradcheck import GradcheckError

from gradwatch.errors import ConfigError
from gradwatch.layout import ROOT, bounds
from gradwatch.origin import tensors

PASS, WARN, FAIL = "pass", "warn", "fail"
STATUSES = (PASS, WARN, FAIL)
#: ``--fail-on`` choices: ``warning`` (warn and fail count) or ``error`` (only fail counts)
FAIL_ON = ("warning", "error")
CHECKS = ("gradient_path", "train_mode", "gradient_flow", "activations", "overfit_batch", "autograd_functions")
#: names listed in one piece of evidence before "... and N more"
NAME_CAP = 8
#: activations whose units die at exactly zero
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
#: gradcheck's element-wise absolute tolerance (its default)
GRADCHECK_ATOL = 1e-5
#: torch's private helper that recomputes full Jacobians for a failing fast gradcheck's message
_SLOW_REPORT = "_run_slow_mode_and_get_error"

LossFn = Callable[..., Any]

HINTS = {
    "unused": ("put these parameters on the path to the loss: use the module's output in forward or remove the "
               "module; look for .detach(), .data, torch.no_grad() or a non-differentiable op (argmax, round, "
               "an integer cast) that cuts the graph; layers kept in a plain Python list must be in nn.ModuleList"),
    "no_params": ("give the model trainable parameters: register layers as attributes or in nn.ModuleList / "
                  "nn.ModuleDict (not a Python list), and check requires_grad"),
    "frozen": "if they should learn, set requires_grad=True and give them to the optimizer; if frozen on purpose, "
              "ignore this",
    "mode": ("call model.train() before training: eval mode turns dropout off and freezes batch-norm statistics; "
             "ignore this for a sub-network kept in eval mode on purpose"),
    "nonfinite_grad": ("a NaN/Inf at initialisation comes from log(0), division by zero, sqrt or pow of negatives, "
                       "or exp overflow: add an epsilon, clamp, or compute the loss from logits "
                       "(cross_entropy, binary_cross_entropy_with_logits)"),
    "vanishing": ("use ReLU-family activations instead of sigmoid/tanh in deep stacks, Kaiming (He) or Xavier "
                  "initialisation, normalisation layers (BatchNorm/LayerNorm) and residual connections"),
    "no_signal": ("the loss does not change with the parameters: check that the output feeds the loss and the "
                  "targets are not constant, and use Kaiming/Xavier initialisation"),
    "exploding": ("lower the learning rate and add warmup, clip gradients (torch.nn.utils.clip_grad_norm_), and "
                  "check the initialisation scale and normalisation of the layers named"),
    "dead": ("a large negative bias or a poor initialisation keeps the units off: initialise biases at zero, use "
             "Kaiming initialisation, normalise before the activation, or use LeakyReLU/GELU"),
    "saturated": ("the activation's inputs are too large: use Xavier initialisation, normalise or rescale the "
                  "inputs before it, or use a non-saturating activation (ReLU/GELU)"),
    "nonfinite_act": ("the first non-finite output is where the NaN/Inf is born (or the batch already has one): "
                      "check that module's inputs, clamp or add an epsilon there, and clean the data"),
    "no_fit": ("a model that cannot fit one batch has a bug: check that targets match the inputs, that the loss "
               "gets what it expects (logits, not probabilities), that no layer is frozen by mistake, and that the "
               "optimizer sees the parameters; try a higher --lr"),
    "diverged": "lower the learning rate (--lr) and add warmup, and clip gradients",
    "slow_fit": ("it learns, but slowly: allow more --steps or a higher --lr; if that does not help, check the "
                 "initialisation (Kaiming/Xavier), normalisation and the loss"),
    "trivial": "use a batch whose targets the model does not already match at initialisation",
    "gradcheck": ("the backward does not match finite differences of the forward: check each returned gradient's "
                  "formula and shape, one per forward input and in the same order (None for non-tensor inputs)"),
    "gradcheck_error": ("gradcheck could not run in float64 on these inputs: test the Function yourself with "
                        "torch.autograd.gradcheck on small float64 inputs"),
    "crashed": "fix the error: run the model on the batch by hand to see the full traceback",
}


# ------------------------------------------------------------------------------------------ results and options
@dataclass
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: the check, one of :data:`CHECKS`.
        status: ``pass``, ``warn`` or ``fail``.
        evidence: what was measured, in one or a few sentences.
        suggestion: what to do about it (empty when it passed).
        data: the measured values, for notebooks (layer norms, losses ...), and ``seconds``.
    """

    name: str
    status: str
    evidence: str
    suggestion: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, str]:
        """The ``--format json`` object: check, status, evidence, suggestion."""
        return {"check": self.name, "status": self.status, "evidence": self.evidence, "suggestion": self.suggestion}


@dataclass(frozen=True)
class DoctorOptions:
    """Thresholds and settings of :func:`diagnose`.

    Attributes:
        steps: most Adam steps of the overfit check (it stops early once the loss is low enough).
        lr: Adam learning rate of the overfit check.
        overfit_target: the overfit check passes when the loss falls to this fraction of its initial value.
        overfit_floor: ... or below this absolute value.
        vanishing_ratio: a layer whose gradient RMS is below this times the median layer's RMS is vanishing.
        vanishing_norm: a global gradient norm below this means no learning signal at all.
        exploding_norm: a global gradient norm above this is exploding.
        spread_ratio: a largest/smallest layer gradient RMS ratio above this is vanishing when the smallest
            layer comes before the largest in model order (the gradient shrinks towards the input), else
            exploding (it grows towards the input).
        dead_fraction: a ReLU-family layer with more than this fraction of dead units is reported.
        saturation_fraction: a sigmoid/tanh-like layer with more than this fraction of saturated outputs is reported.
        seed: seed of torch, Python and NumPy for the checks (their states are restored afterwards).
        device: run the checks on this device (the copies and the batch are moved); ``None``: where the model is.
        skip: checks not to run.
    """

    steps: int = 100
    lr: float = 1e-3
    overfit_target: float = 0.1
    overfit_floor: float = 1e-3
    vanishing_ratio: float = 1e-4
    vanishing_norm: float = 1e-8
    exploding_norm: float = 1e3
    spread_ratio: float = 1e5
    dead_fraction: float = 0.5
    saturation_fraction: float = 0.5
    seed: int = 0
    device: str | None = None
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.steps, int) and self.steps >= 1, "steps", "an integer >= 1", self.steps)
        _require(_real(self.lr) and self.lr >= 0, "lr", "a number >= 0", self.lr)
        for name in ("overfit_target", "dead_fraction", "saturation_fraction"):
            value = getattr(self, name)
            _require(_real(value) and 0 < value < 1, name, "a number between 0 and 1 (exclusive)", value)
        for name in ("overfit_floor", "vanishing_ratio", "vanishing_norm", "exploding_norm", "spread_ratio"):
            value = getattr(self, name)
            _require(_real(value) and value > 0, name, "a number > 0", value)
        _require(isinstance(self.seed, int), "seed", "an integer", self.seed)
        _require(self.device is None or isinstance(self.device, (str, torch.device)), "device",
                 "a device string such as 'cpu' or 'cuda:0'", self.device)
        unknown = sorted(set(self.skip) - set(CHECKS))
        _require(not unknown, "skip", f"a list of checks among {', '.join(CHECKS)}", unknown)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> DoctorOptions:
        """Options from keyword arguments, refusing unknown names.

        Raises:
            ConfigError: an unknown option or an invalid value.
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown doctor option {unknown[0]!r}; valid options: {', '.join(known)}")
        values = dict(options)
        if "skip" in values:
            values["skip"] = (values["skip"],) if isinstance(values["skip"], str) else tuple(values["skip"])
        return cls(**values)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, name: str, what: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"doctor option {name} must be {what}, got {value!r}")


def exit_code(results: Sequence[CheckResult], fail_on: str = "error") -> int:
    """0 when no check reached ``fail_on`` (``error``: a fail; ``warning``: a warn or a fail), else 1.

    Raises:
        ConfigError: ``fail_on`` is not one of :data:`FAIL_ON`.
    """
    if fail_on not in FAIL_ON:
        raise ConfigError(f"fail_on must be one of {', '.join(FAIL_ON)}, got {fail_on!r}")
    bad = {FAIL} if fail_on == "error" else {WARN, FAIL}
    return 1 if any(r.status in bad for r in results) else 0


# ---------------------------------------------------------------------------------------------- the contract
def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def _names(names: Sequence[str], cap: int = NAME_CAP) -> str:
    """Names joined by commas, at most ``cap`` of them, then how many more."""
    shown = ", ".join(names[:cap])
    return shown + (f" ... and {len(names) - cap} more" if len(names) > cap else "")


def _describe(obj: object) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} item{'s' * (len(obj) != 1)}"
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def validate_batch(batch: object, where: str = "batch") -> None:
    """Check that a batch is a tensor or a (nested) tuple, list or mapping of tensors.

    Raises:
        ConfigError: naming the first offending element, e.g. ``batch[1]['mask'] is a str``.
    """
    if isinstance(batch, torch.Tensor):
        return
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where} has a key {key!r}; dict keys must be strings (they are keyword arguments)")
            validate_batch(value, f"{where}[{key!r}]")
        return
    if isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            validate_batch(value, f"{where}[{i}]")
        return
    raise ConfigError(f"{where} is {_describe(batch)}; a batch holds tensors, in tuples, lists or dicts")


def validate(model: object, batch: object, loss_fn: object) -> None:
    """Check ``(model, batch, loss_fn)`` against the contract of the module docstring.

    Raises:
        ConfigError: the first violation, in one line.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model is {_describe(model)}; it must be a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"the loss_fn is {_describe(loss_fn)}; it must be callable or None")
    validate_batch(batch)
    if not any(True for _ in tensors(batch)):
        raise ConfigError("the batch holds no tensor")
    if loss_fn is not None and isinstance(batch, (tuple, list)) and len(batch) != 2:
        raise ConfigError(f"with a loss_fn the batch must be a pair (inputs, targets), a tensor or a dict of inputs; "
                          f"got {_describe(batch)}")


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {key: _map_tensors(value, fn) for key, value in batch.items()}
    items = [_map_tensors(value, fn) for value in batch]
    if isinstance(batch, tuple):
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return items


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a mapping."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss of one batch, by the contract of the module docstring.

    Raises:
        ConfigError: the loss is not a scalar floating tensor, or (without a loss_fn) the output carries no loss.
    """
    if loss_fn is None:
        loss = _loss_of_output(call_model(model, batch))
    elif isinstance(batch, (tuple, list)):
        inputs, targets = batch
        loss = loss_fn(call_model(model, inputs), targets)
    else:
        loss = loss_fn(call_model(model, batch))
    where = "without a loss_fn the loss is the model's output, which" if loss_fn is None else "loss_fn"
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{where} gave {_describe(loss)} as the loss; it must be a scalar tensor")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ConfigError(f"{where} gave a {loss.dtype} tensor of shape {tuple(loss.shape)} as the loss; it must be "
                          "a floating-point scalar (reduce it, e.g. with .mean())")
    return loss.reshape(())


def _loss_of_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise ConfigError(f"without a loss_fn the model must return the loss (a scalar tensor) or an output with "
                          f".loss; it returned {_describe(output)}")
    return loss


# ------------------------------------------------------------------------------------------ loading a target
def load_target(target: str) -> tuple[nn.Module, Any, LossFn | None]:
    """Import ``path/to/script.py:factory`` or ``package.module:factory`` and call the factory.

    A script is imported from its file, with its directory on ``sys.path``; a module with
    ``importlib.import_module``, with the current directory on ``sys.path`` (as ``python -m`` does).
    The path entry is removed again once the factory has returned. ``factory`` may be dotted
    (``module:Class.build``). The factory is called with no arguments and must return
    ``(model, batch, loss_fn)``.

    Raises:
        ConfigError: the target cannot be parsed, imported or called, or returns something else (one line).
    """
    location, sep, attr = target.rpartition(":")
    if not sep or not location or not attr:
        raise ConfigError(f"target {target!r} must be path/to/script.py:factory or package.module:factory")
    is_path = location.endswith(".py") or "/" in location or os.sep in location
    folder = Path(location).resolve().parent if is_path else Path.cwd()
    with _on_sys_path(folder):
        module = _import_file(location) if is_path else _import_module(location)
        factory = _resolve(module, attr, location)
        try:
            made = factory()
        except (Exception, SystemExit) as exc:
            raise ConfigError(f"factory {target!r} raised {_one_line(exc)}") from None
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        raise ConfigError(f"factory {target!r} returned {_describe(made)}; it must return (model, batch, loss_fn)")
    model, batch, loss_fn = made
    try:
        validate(model, batch, loss_fn)
    except ConfigError as exc:
        raise ConfigError(f"factory {target!r}: {exc}") from None
    return model, batch, loss_fn


@contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _import_file(location: str) -> Any:
    path = Path(location)
    if not path.is_file():
        raise ConfigError(f"no such file: {location!r}" if not path.exists() else f"not a file: {location!r}")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"gradwatch_doctor_target_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {location!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None
    return module


def _import_module(location: str) -> Any:
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        if exc.name and (location == exc.name or location.startswith(exc.name + ".")):
            raise ConfigError(f"no module named {exc.name!r} (looked on sys.path and in the current directory; "
                              "a script needs its .py path)") from None
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None


def _resolve(module: Any, attr: str, location: str) -> Callable[[], Any]:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            offered = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__)
            hint = f" (it defines: {_names(offered)})" if offered else ""
            raise ConfigError(f"{location!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{location}:{attr} is {_describe(obj)}, not a callable factory")
    return obj  # type: ignore[no-any-return]


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
    for name, module in model.named_modules():
        owned = [canonical[id(p)] for p in module.parameters(recurse=False) if p.requires_grad]
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
        self.modules = [(name or ROOT, m) for name, m in model.named_modules()]
        self.types = types
        self.stats: dict[str, _Activation] = {}
        self.first_nonfinite: tuple[str, bool] | None = None  # (module, whether its inputs were finite)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _ActivationRecorder:
        for name, module in self.modules:
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any, Any], None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            with torch.no_grad():
                if self.first_nonfinite is None and not _finite(output):
                    self.first_nonfinite = (name, _finite(args) and _finite(kwargs))
                if next(module.children(), None) is None:
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


# ------------------------------------------------------------------------------------------------ the checks
def check_gradient_path(ctx: _Context) -> CheckResult:
    """Trainable parameters that receive no gradient (fail), frozen parameters (warn)."""
    probe = ctx.probe()
    name = "gradient_path"
    data: dict[str, Any] = {"trainable": probe.trainable, "frozen": probe.frozen}
    frozen = f"{len(probe.frozen)} frozen (requires_grad=False): {_names(probe.frozen)}" if probe.frozen else ""
    if not probe.trainable:
        evidence = "the model has no trainable parameters" + (f"; {frozen}" if frozen else "")
        return CheckResult(name, FAIL, evidence, HINTS["no_params"], data)
    missing = [n for n in probe.trainable if probe.grads[n] is None]
    data["unused"] = missing
    if missing:
        what = ("the loss does not depend on any trainable parameter (it has no grad_fn): "
                if not probe.requires_grad else "")
        evidence = (f"{what}{len(missing)} of {len(probe.trainable)} trainable parameters got no gradient, "
                    f"unused or detached: {_names(missing)}")
        return CheckResult(name, FAIL, evidence + (f"; {frozen}" if frozen else ""), HINTS["unused"], data)
    if probe.frozen:
        return CheckResult(name, WARN, f"{frozen}: frozen by mistake?", HINTS["frozen"], data)
    return CheckResult(name, PASS, f"all {len(probe.trainable)} trainable parameters received a gradient; none frozen",
                       data=data)


def check_train_mode(ctx: _Context) -> CheckResult:
    """The model in eval mode, or submodules in eval mode under a model in train mode (warn)."""
    name = "train_mode"
    model = ctx.model
    if not model.training:
        return CheckResult(name, WARN, f"the model ({type(model).__name__}) is in eval mode (model.training is False)",
                           HINTS["mode"], {"eval": [ROOT]})
    modules = dict(model.named_modules())
    top = [n for n, m in modules.items() if n and not m.training and modules[n.rpartition(".")[0]].training]
    if top:
        listed = [f"{n} ({type(modules[n]).__name__})" for n in top]
        evidence = f"the model is in train mode but {len(top)} submodule(s) are in eval mode: {_names(listed)}"
        return CheckResult(name, WARN, evidence, HINTS["mode"], {"eval": top})
    return CheckResult(name, PASS, f"the model and its {len(modules) - 1} submodules are in train mode", data={})


def _layer_norms(probe: Probe) -> list[tuple[str, float, float, bool]]:
    """(layer, gradient norm, per-element RMS, finite) of each layer that received a gradient."""
    out = []
    for layer, params in probe.layers:
        grads = [g for g in (probe.grads[p] for p in params) if g is not None]
        if not grads:
            continue
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        numel = sum(g.numel() for g in grads)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        norm = math.sqrt(squares) if math.isfinite(squares) else math.inf
        out.append((layer, norm, norm / math.sqrt(max(numel, 1)), finite))
    return out


def check_gradient_flow(ctx: _Context) -> CheckResult:
    """Per-layer gradient norms at initialisation: non-finite (fail), vanishing, exploding (warn)."""
    name = "gradient_flow"
    probe = ctx.probe()
    opts = ctx.options
    layers = _layer_norms(probe)
    if not layers:
        return CheckResult(name, FAIL, "no layer received a gradient (see gradient_path)", HINTS["unused"])
    data: dict[str, Any] = {"loss": probe.loss, "norms": {layer: norm for layer, norm, _, _ in layers}}
    bad = [layer for layer, _, _, finite in layers if not finite]
    if bad or not math.isfinite(probe.loss):
        evidence = f"loss {probe.loss:.4g}; non-finite gradients in {len(bad)} layer(s): {_names(bad)}"
        return CheckResult(name, FAIL, evidence, HINTS["nonfinite_grad"], {**data, "nonfinite": bad})
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in probe.grads.values() if g is not None))
    data["global_norm"] = total
    shown = _flow_summary(probe, layers, total)
    if total < opts.vanishing_norm:
        evidence = f"global gradient norm {total:.3g} < {opts.vanishing_norm:g}: no learning signal; {shown}"
        return CheckResult(name, FAIL, evidence, HINTS["no_signal"], data)
    findings, hints = _flow_findings(layers, total, opts)
    data.update(findings)
    if not hints:
        return CheckResult(name, PASS, shown, data=data)
    sentences = "; ".join(_flow_sentences(findings, total, opts))
    return CheckResult(name, WARN, f"{sentences}; {shown}", "; ".join(HINTS[h] for h in hints), data)


def _flow_summary(probe: Probe, layers: list[tuple[str, float, float, bool]], total: float) -> str:
    (first, first_norm, _, _), (last, last_norm, _, _) = layers[0], layers[-1]
    if len(layers) == 1:
        return f"1 layer, {first} ({probe.types.get(first, '?')}) gradient norm {first_norm:.3g}"
    return (f"{len(layers)} layers, gradient norm of the first {first} ({probe.types.get(first, '?')}) "
            f"{first_norm:.3g}, of the last {last} ({probe.types.get(last, '?')}) {last_norm:.3g}, global {total:.3g}")


def _flow_findings(layers: list[tuple[str, float, float, bool]], total: float,
                   opts: DoctorOptions) -> tuple[dict[str, Any], list[str]]:
    rms = [(layer, r) for layer, _, r, _ in layers]
    median = statistics.median(r for _, r in rms)
    vanishing = {layer for layer, r in rms if median > 0 and r < opts.vanishing_ratio * median}
    positive = [(i, r) for i, (_, r) in enumerate(rms) if r > 0]
    i_min, smallest = min(positive, key=lambda x: x[1], default=(0, 1.0))
    i_max, largest = max(positive, key=lambda x: x[1], default=(0, 1.0))
    spread = largest / smallest
    shrinking = spread > opts.spread_ratio and i_min < i_max
    if shrinking:
        vanishing |= {layer for layer, r in rms if r < largest / opts.spread_ratio}
    findings: dict[str, Any] = {
        "median_rms": median, "largest_rms": largest, "spread": spread, "shrinking": shrinking,
        "vanishing": [layer for layer, _ in rms if layer in vanishing],
        "exploding": total > opts.exploding_norm or (spread > opts.spread_ratio and not shrinking),
    }
    hints = (["vanishing"] if vanishing else []) + (["exploding"] if findings["exploding"] else [])
    return findings, hints


def _flow_sentences(findings: dict[str, Any], total: float, opts: DoctorOptions) -> list[str]:
    out = []
    names = findings["vanishing"]
    if names:
        rule = f"RMS < {opts.vanishing_ratio:g} x the median layer's ({findings['median_rms']:.3g})"
        if findings["shrinking"]:
            rule += (f" or, as the gradient shrinks {findings['spread']:.3g}x towards the input, "
                     f"< 1/{opts.spread_ratio:g} of the largest ({findings['largest_rms']:.3g})")
        out.append(f"vanishing: {len(names)} layer(s) with gradient {rule}: {_names(names)}")
    if findings["exploding"]:
        if total > opts.exploding_norm:
            out.append(f"exploding: global gradient norm {total:.3g} > {opts.exploding_norm:g}")
        if findings["spread"] > opts.spread_ratio and not findings["shrinking"]:
            out.append(f"exploding: the layer gradient RMS grows {findings['spread']:.3g}x towards the input "
                       f"(limit {opts.spread_ratio:g})")
    return out


def check_activations(ctx: _Context) -> CheckResult:
    """Activations at initialisation: non-finite (fail), dead ReLU units, saturated sigmoid/tanh (warn)."""
    name = "activations"
    bad_inputs = [i for i, t in enumerate(tensors(ctx.batch)) if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad_inputs:
        return CheckResult(name, FAIL, f"the batch itself holds non-finite values (tensor #{bad_inputs[0]} in "
                           "traversal order)", HINTS["nonfinite_act"])
    probe = ctx.probe()
    opts = ctx.options
    if probe.first_nonfinite is not None or not math.isfinite(probe.loss):
        return _nonfinite_activation(probe)
    acts = probe.activations
    dead = {n: a.dead / a.units for n, a in acts.items() if a.units}
    saturated = {n: a.saturated / a.elements for n, a in acts.items() if a.elements}
    data = {"dead_fraction": dead, "saturated_fraction": saturated}
    dead_bad = [n for n, f in dead.items() if f > opts.dead_fraction]
    sat_bad = [n for n, f in saturated.items() if f > opts.saturation_fraction]
    if dead_bad or sat_bad:
        parts = []
        if dead_bad:
            listed = [f"{n} ({acts[n].type}) {dead[n]:.0%} of {acts[n].units}" for n in dead_bad]
            parts.append(f"dead units (zero for every sample) in {len(dead_bad)} layer(s): {_names(listed)}")
        if sat_bad:
            listed = [f"{n} ({acts[n].type}) {saturated[n]:.0%}" for n in sat_bad]
            parts.append(f"saturated outputs (within 1% of a bound) in {len(sat_bad)} layer(s): {_names(listed)}")
        hints = ([HINTS["dead"]] if dead_bad else []) + ([HINTS["saturated"]] if sat_bad else [])
        return CheckResult(name, WARN, "; ".join(parts), "; ".join(hints), data)
    return CheckResult(name, PASS, _activation_summary(acts, dead, saturated), data=data)


def _nonfinite_activation(probe: Probe) -> CheckResult:
    if probe.first_nonfinite is None:
        evidence = f"every module's output is finite but the loss is {probe.loss}: the loss computation makes it"
        return CheckResult("activations", FAIL, evidence, HINTS["nonfinite_grad"], {"first_nonfinite": None})
    first, inputs_finite = probe.first_nonfinite
    evidence = f"the first non-finite output is from {first} ({probe.types.get(first, '?')})"
    if inputs_finite:
        evidence += ", whose inputs were finite: it is born there"
    else:
        parent = first.rpartition(".")[0] or ROOT
        evidence += (f", but its inputs were already non-finite: it is born in code between modules, e.g. in the "
                     f"forward of {parent} ({probe.types.get(parent, '?')})")
    return CheckResult("activations", FAIL, evidence, HINTS["nonfinite_act"], {"first_nonfinite": first})


def _activation_summary(acts: dict[str, _Activation], dead: dict[str, float], saturated: dict[str, float]) -> str:
    parts = [f"{len(acts)} leaf modules ran, every module's output finite"]
    if dead:
        worst = max(dead, key=lambda n: dead[n])
        parts.append(f"most dead units {dead[worst]:.0%} in {worst} ({acts[worst].type})")
    if saturated:
        worst = max(saturated, key=lambda n: saturated[n])
        parts.append(f"most saturated {saturated[worst]:.0%} in {worst} ({acts[worst].type})")
    if not dead and not saturated:
        parts.append("no ReLU-family or saturating activation module (functional ones are not seen)")
    return "; ".join(parts)


def check_overfit(ctx: _Context) -> CheckResult:
    """Adam on the one batch: the loss must fall to ``overfit_target`` of its start (or below ``overfit_floor``)."""
    name = "overfit_batch"
    opts = ctx.options
    model = ctx.fresh_model()
    batch = ctx.fresh_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return CheckResult(name, FAIL, "no trainable parameters to fit", HINTS["no_params"])
    optimizer = torch.optim.Adam(params, lr=opts.lr)
    losses: list[float] = []
    for step in range(opts.steps + 1):
        loss = compute_loss(model, batch, ctx.loss_fn)
        value = float(loss.detach())
        losses.append(value)
        data = {"losses": losses, "steps": step, "lr": opts.lr}
        if not math.isfinite(value):
            return CheckResult(name, FAIL, f"the loss became {value} at step {step} (Adam, lr {opts.lr:g}; "
                               f"initial {losses[0]:.4g})", HINTS["diverged"], data)
        if step == 0 and 0 <= value < opts.overfit_floor:
            return CheckResult(name, WARN, f"the initial loss {value:.3g} is already below {opts.overfit_floor:g}: "
                               "nothing to learn on this batch", HINTS["trivial"], data)
        if (step and _fitted(losses[0], value, opts)) or step == opts.steps:
            break
        if not loss.requires_grad:
            return CheckResult(name, FAIL, "the loss does not depend on any trainable parameter", HINTS["unused"], data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return _overfit_result(losses, opts)


def _fitted(initial: float, value: float, opts: DoctorOptions) -> bool:
    if initial >= opts.overfit_floor and value < opts.overfit_floor:
        return True
    return initial - value >= (1 - opts.overfit_target) * abs(initial)


def _overfit_result(losses: list[float], opts: DoctorOptions) -> CheckResult:
    initial, final, steps = losses[0], losses[-1], len(losses) - 1
    data = {"losses": losses, "steps": steps, "lr": opts.lr}
    ratio = f" ({final / initial:.1%} of the initial)" if initial > 0 else ""
    evidence = f"loss {initial:.4g} -> {final:.4g}{ratio} after {steps} of {opts.steps} Adam steps (lr {opts.lr:g})"
    if _fitted(initial, final, opts):
        return CheckResult("overfit_batch", PASS, evidence, data=data)
    goal = f"goal: {opts.overfit_target:.0%} of the initial or < {opts.overfit_floor:g}"
    if final < initial:
        return CheckResult("overfit_batch", WARN, f"{evidence}; {goal}", HINTS["slow_fit"], data)
    return CheckResult("overfit_batch", FAIL, f"{evidence}: the loss did not fall", HINTS["no_fit"], data)


def check_autograd_functions(ctx: _Context) -> CheckResult:
    """``gradcheck`` (float64, fast mode) of each custom autograd Function reached by the forward."""
    name = "autograd_functions"
    calls = ctx.probe().calls
    if not calls:
        return CheckResult(name, PASS, "no custom autograd.Function reached", data={"functions": {}})
    outcomes = {call.cls.__qualname__: _gradcheck(call) for call in calls}
    data = {"functions": {cls: {"status": s, "message": m} for cls, (s, m) in outcomes.items()}}
    failed = [f"{cls}: {m}" for cls, (s, m) in outcomes.items() if s == FAIL]
    errored = [f"{cls}: {m}" for cls, (s, m) in outcomes.items() if s == WARN]
    passed = [cls for cls, (s, _) in outcomes.items() if s == PASS]
    skipped = [cls for cls, (s, _) in outcomes.items() if s == "skip"]
    parts = ([f"gradcheck failed for {'; '.join(failed)}"] if failed else []) + (
        [f"gradcheck could not run for {'; '.join(errored)}"] if errored else []) + (
        [f"gradcheck passed for {_names(passed)}"] if passed else []) + (
        [f"no input requiring grad (not checked): {_names(skipped)}"] if skipped else [])
    if failed:
        return CheckResult(name, FAIL, "; ".join(parts), HINTS["gradcheck"], data)
    if errored:
        return CheckResult(name, WARN, "; ".join(parts), HINTS["gradcheck_error"], data)
    return CheckResult(name, PASS, "; ".join(parts), data=data)


def _as_float64(value: Any, grad: bool) -> Any:
    if not isinstance(value, _Saved):
        return value
    tensor = value.tensor
    if tensor.is_floating_point():
        tensor = tensor.to(torch.float64)
        if grad and value.requires_grad:
            tensor.requires_grad_(True)
    elif tensor.is_complex():
        tensor = tensor.to(torch.complex128)
        if grad and value.requires_grad:
            tensor.requires_grad_(True)
    return tensor


def _gradcheck(call: _Call) -> tuple[str, str]:
    """(status, message) of one Function: pass, fail (a wrong gradient), warn (could not run), skip."""
    inputs = tuple(_as_float64(a, grad=True) for a in call.args)
    kwargs = {k: _as_float64(v, grad=False) for k, v in call.kwargs.items()}
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        return "skip", "no input requires grad"

    def apply(*args: Any) -> Any:
        return call.cls.apply(*args, **kwargs)

    try:
        atol = _fast_atol(apply, inputs)
        with _no_slow_error_report():
            torch.autograd.gradcheck(apply, inputs, atol=atol, fast_mode=True, check_undefined_grad=False)
    except GradcheckError as exc:
        return FAIL, _one_line(exc).removeprefix("GradcheckError: ").rstrip(",:")
    except Exception as exc:
        return WARN, _one_line(exc)
    return PASS, "gradcheck passed"


@contextmanager
def _no_slow_error_report() -> Iterator[None]:
    """Keep a failing fast-mode gradcheck fast.

    On a mismatch, fast mode recomputes both Jacobians in full (slow mode) only to print them in
    the error message: minutes for a Function of a weight matrix. The doctor reports the message's
    first line, so that step is replaced by an empty report while the check runs (and restored).
    """
    module = sys.modules["torch.autograd.gradcheck"]
    original = getattr(module, _SLOW_REPORT, None)
    if original is None:
        yield
        return
    setattr(module, _SLOW_REPORT, lambda *args, **kwargs: "")
    try:
        yield
    finally:
        setattr(module, _SLOW_REPORT, original)


def _fast_atol(apply: Callable[..., Any], inputs: tuple[Any, ...]) -> float:
    """The ``atol`` that makes fast-mode gradcheck about as strict as the slow mode's default 1e-5.

    Fast mode compares ``v^T J u`` for random non-negative unit vectors ``u``, ``v`` and scales
    ``atol`` by ``sum(u) * sum(v)``, about ``0.75 * sqrt(n_in * n_out)``: on inputs of thousands of
    elements that tolerance swallows a wrong backward. Dividing by that factor undoes it; float64
    finite differences are far more accurate than the 1e-5 left.
    """
    with torch.no_grad():
        outputs = list(tensors(apply(*inputs)))
    n_in = max((x.numel() for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad), default=1)
    n_out = max((y.numel() for y in outputs), default=1)
    return GRADCHECK_ATOL / max(1.0, 0.75 * math.sqrt(n_in * n_out))


_CHECK_FUNCTIONS: dict[str, Callable[[_Context], CheckResult]] = {
    "gradient_path": check_gradient_path,
    "train_mode": check_train_mode,
    "gradient_flow": check_gradient_flow,
    "activations": check_activations,
    "overfit_batch": check_overfit,
    "autograd_functions": check_autograd_functions,
}


# ------------------------------------------------------------------------------------------------------ entry
def diagnose(model: nn.Module, batch: Any, loss_fn: LossFn | None = None, **options: Any) -> list[CheckResult]:
    """Run the doctor's checks on a model and one batch; the model itself is never modified.

    Args:
        model: the model, as it would start training.
        batch: one batch, by the contract of the module docstring.
        loss_fn: ``loss_fn(output, targets)``, or None when the model returns its loss.
        **options: the fields of :class:`DoctorOptions` (``steps``, ``lr``, ``device``, thresholds, ``skip``).

    Returns:
        One :class:`CheckResult` per check run, in the order of :data:`CHECKS`. A check that raises
        an unexpected error is a ``fail`` carrying the error's message.

    Raises:
        ConfigError: an invalid option, or ``(model, batch, loss_fn)`` not keeping the contract
            (including a loss that is not a scalar).
    """
    opts = DoctorOptions.from_kwargs(options)
    validate(model, batch, loss_fn)
    device, batch_device = _resolve_device(model, opts.device)
    ctx = _Context(model, batch, loss_fn, opts, device, batch_device)
    results = []
    with _rng_restored(batch_device):
        for name, fn in _CHECK_FUNCTIONS.items():
            if name not in opts.skip:
                results.append(_run_check(name, fn, ctx))
    return results


def _run_check(name: str, fn: Callable[[_Context], CheckResult], ctx: _Context) -> CheckResult:
    start = time.perf_counter()
    _seed(ctx.options.seed)
    try:
        result = fn(ctx)
    except ConfigError:
        raise
    except Exception as exc:
        result = CheckResult(name, FAIL, f"the check raised {_one_line(exc)}", HINTS["crashed"])
    result.data["seconds"] = time.perf_counter() - start
    return result


__all__ = [
    "CHECKS",
    "FAIL_ON",
    "CheckResult",
    "DoctorOptions",
    "Probe",
    "call_model",
    "compute_loss",
    "diagnose",
    "exit_code",
    "load_target",
    "validate",
    "validate_batch",
]
