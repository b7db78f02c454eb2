"""Cause (judge stage, rare path): data, precision, not reproducible, or model — by replays of the same step.

- **data**: the batch itself holds NaN/Inf; or the samples that went non-finite are outliers of
  the batch (values far beyond the others'); or, the batch being finite, only some samples went
  non-finite at an op whose offending input no trainable weight enters (a 0 that the batch puts
  into a log or a division's divisor: a box of area 0, an empty row);
- **precision**: the origin module, replayed alone in float32 (float64 when it already ran in
  float32) with autocast off, stays finite;
- **not reproducible**: the replay (same inputs, same RNG) is finite where the step was not
  (decided by :class:`gradwatch.step.origin.Tracker`);
- **model**: reproducible in full precision with finite inputs: a bug at the line found, or
  diverged weights (the parameter norms that grew since gradwatch began watching are named);
- **weights**: the weights already hold NaN/Inf when the step begins (an earlier update applied
  non-finite gradients): found before any replay (see :func:`gradwatch.rootcause.diagnose.poisoned`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from gradwatch.rootcause.facts import g
from gradwatch.rootcause.locate import Located
from gradwatch.rootcause.state import LOW_PRECISION, Autocast, Rng, devices, finite, first_tensor, floats
from gradwatch.wording import layer

DATA, PRECISION, NOT_REPRODUCIBLE, MODEL, WEIGHTS = "data", "precision", "not_reproducible", "model", "weights"
#: a parameter whose norm grew by more than this factor since watching began "grew"
GREW = 4.0
#: parameters named at most
NAMED = 3
#: the smallest per-element RMS growth is measured from
FLOOR = 0.01


def low_precision(autocast: Autocast, module: nn.Module, call: dict[str, Any], output: Any) -> bool:
    """Whether the module ran below float32: under autocast, or with half-precision weights or values."""
    if autocast.enabled:
        return True
    held = [*module.parameters(), *floats((call.get("args"), call.get("kwargs"))), *floats(output)]
    return any(t.dtype in LOW_PRECISION for t in held)


def _up(dtype: torch.dtype) -> Any:
    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().to(dtype).requires_grad_(x.requires_grad)
        return x
    return up


def replay_wider(module: nn.Module, call: dict[str, Any], located: Located, rng: Rng,
                 dtype: torch.dtype) -> bool:
    """Replay the origin module's call alone in ``dtype`` with autocast off: whether it stays finite.

    Forward: the module's output. Backward: the gradients of its inputs and weights, from the
    gradient that reached it (in ``dtype`` too). The module's own weights are not changed: the
    replay runs on copies through ``torch.func.functional_call``.
    """
    from torch.func import functional_call

    up = _up(dtype)
    params = {n: up(p) for n, p in module.named_parameters()}
    state = {**params, **{n: up(b) for n, b in module.named_buffers()}}
    args, kwargs = pytree.tree_map(up, (tuple(call["args"]), dict(call["kwargs"])))
    rng.set(call["rng"])
    with Autocast.off(devices(module) or ["cpu"]), torch.enable_grad():
        output = functional_call(module, state, args, kwargs)
        if located.phase == "forward":
            return finite(output)
        out = first_tensor(output)
        grad_out = next((t for t in located.grad_output if isinstance(t, torch.Tensor)), None)
        if out is None or grad_out is None or not out.requires_grad:
            return finite(output)
        wanted = [t for t in [*floats((args, kwargs)), *params.values()] if t.requires_grad]
        if not wanted:
            return finite(output)
        grads = torch.autograd.grad(out, wanted, grad_outputs=grad_out.detach().to(dtype), allow_unused=True)
    return finite(output, [x for x in grads if x is not None])


def grown(model: nn.Module, reference: dict[str, float]) -> list[dict[str, Any]]:
    """The parameters whose norm grew by more than :data:`GREW` times since ``reference`` was taken.

    A parameter that started below an RMS of :data:`FLOOR` per element (a bias or a projection
    initialised at zero) is named only when it is no longer finite: any learning grows it from zero,
    and a ratio to zero says nothing.
    """
    named = [(n, p) for n, p in model.named_parameters() if n in reference and p.numel()]
    if not named:
        return []
    try:
        with torch.no_grad():
            now = torch.stack([p.detach().float().norm().to("cpu") for _, p in named]).tolist()
    except Exception:  # sharded (DTensor) or scattered parameters: no weights named
        return []
    out = []
    for (name, p), value in zip(named, now):
        before, floor = reference[name], FLOOR * math.sqrt(p.numel())
        ratio = value / max(before, floor)
        if (ratio > GREW and before >= floor) or not math.isfinite(value):
            out.append({"param": name, "from": before, "to": value, "ratio": ratio})
    out.sort(key=lambda d: -d["ratio"] if d["ratio"] == d["ratio"] else float("-inf"))
    return out[:NAMED]


def precision(module: nn.Module, call: dict[str, Any], located: Located, autocast: Autocast,
              rng: Rng) -> tuple[bool | None, str]:
    """Whether the NaN/Inf disappears in a wider type: (True/False, the type's name), or (None, why not)."""
    lower = low_precision(autocast, module, call, located.output)
    dtype = torch.float32 if lower else torch.float64
    name = str(dtype).removeprefix("torch.")
    try:
        return replay_wider(module, call, located, rng, dtype), name
    except Exception as exc:  # a module that cannot run in another type (a hard-coded dtype, a fused kernel)
        return None, f"the replay in {name} failed ({type(exc).__name__}: {exc})"


def words_precision(located: Located, dtype: str, autocast: Autocast, op: str | None) -> str:
    """The detail of a precision cause: what ran narrower, and what to do."""
    what = f"{layer(located.name)} stays finite when replayed in {dtype}"
    if dtype == "float32":
        ran = f"{str(autocast.dtype).removeprefix('torch.')} autocast" if autocast.enabled else "half precision"
        fix = f"use bf16 instead of fp16, loss scaling (torch.amp.GradScaler), or run {op or 'that op'} in float32"
        return f"{what} (it ran under {ran}): {fix}"
    return (f"{what}: its values exceed float32's range; rescale its inputs (normalize), or compute "
            f"{op or 'that op'} in float64")


def words_batch(rows: list[int], batch: int, culprit: str | None, line: str | None) -> str:
    """The detail of a data cause whose batch is finite: the samples' own values hit a pole of the op."""
    some = f"only {len(rows):,} of the batch's {batch:,} samples" if len(rows) < batch else "the batch's sample"
    at = f" at {line}" if line else ""
    return (f"{some} went NaN/Inf, by {culprit or 'their values'}{at}, a value the batch alone makes: no "
            "trainable weight enters it")


def words_model(grew: list[dict[str, Any]], dtype: str | None, weightless: bool = False) -> str:
    """The detail of a model cause: reproducible in full precision, with the weights that grew (or,
    ``weightless``, at an op whose offending input no trainable weight enters, for every sample).
    """
    where = f"in {dtype} " if dtype else ""
    if weightless:
        return (f"reproducible {where}with a finite batch, and every sample of the batch makes it at an op whose "
                "offending input no trainable weight enters: a bug in the code at that line (or a batch whose "
                "every sample is bad), not diverged weights")
    text = f"reproducible {where}with a finite batch: a bug in the code at that line, or diverged weights"
    if grew:
        named = ", ".join(f"{layer(d['param'])} {g(d['from'])} -> {g(d['to'])} (x{g(d['ratio'])})" for d in grew)
        return f"{text}; parameter norms that grew since gradwatch began watching: {named}"
    return (f"{text}; no parameter norm grew more than {GREW:g}x since gradwatch began watching, so the op's "
            "inputs are to blame")
