"""Doctor check ``autograd_functions``: a float64 gradcheck of every custom ``autograd.Function`` reached."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.gradcheck import GradcheckError

from gradwatch.doctor.context import _Call, _Context, _Saved
from gradwatch.doctor.results import _SLOW_REPORT, FAIL, GRADCHECK_ATOL, HINTS, PASS, WARN, CheckResult
from gradwatch.doctor.target import _names, _one_line
from gradwatch.step.origin import tensors


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
