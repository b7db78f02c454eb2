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

import time
from collections.abc import Callable
from typing import Any

from torch import nn

from gradwatch.doctor.checks import (
    check_activations,
    check_gradient_flow,
    check_gradient_path,
    check_overfit,
    check_train_mode,
)
from gradwatch.doctor.context import Probe, _Context, _resolve_device, _rng_restored, _seed
from gradwatch.doctor.functions import check_autograd_functions
from gradwatch.doctor.results import (
    CHECKS,
    FAIL,
    FAIL_ON,
    HINTS,
    PASS,
    STATUSES,
    WARN,
    CheckResult,
    DoctorOptions,
    LossFn,
    exit_code,
)
from gradwatch.doctor.target import _one_line, call_model, compute_loss, load_target, validate, validate_batch
from gradwatch.errors import ConfigError

# ------------------------------------------------------------------------------------------------------ entry
#: the checks, in the order of CHECKS
_CHECK_FUNCTIONS: dict[str, Callable[[_Context], CheckResult]] = {
    "gradient_path": check_gradient_path,
    "train_mode": check_train_mode,
    "gradient_flow": check_gradient_flow,
    "activations": check_activations,
    "overfit_batch": check_overfit,
    "autograd_functions": check_autograd_functions,
}


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
    "FAIL",
    "FAIL_ON",
    "PASS",
    "STATUSES",
    "WARN",
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
