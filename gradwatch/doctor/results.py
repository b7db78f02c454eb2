"""Doctor results: statuses, hints, :class:`CheckResult`, :class:`DoctorOptions`, exit codes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from gradwatch.errors import ConfigError

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
    "nonfinite_loss": ("the model or the loss computes NaN/Inf on this batch at initialisation: check the batch for "
                       "NaN/Inf and the loss for log(0), division by zero and exp of large values (a VAE's "
                       "logvar.exp()); the gradient_flow and activations checks name the layer when it is in "
                       "the model"),
    "slow_fit": ("it learns, but slowly: allow more --steps or a higher --lr; if that does not help, check the "
                 "initialisation (Kaiming/Xavier), normalisation and the loss. A loss with a floor above 0 (a "
                 "VAE's KL term, label smoothing, soft targets) cannot reach the goal: --skip overfit_batch"),
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
