"""Origin: where a NaN/Inf was born — found by replaying the offending step, only when one occurs.

On every step the tracker only keeps references (no copies) to the root module's inputs and the
RNG state of each forward call, and the gradient that arrives at the model's output (or, when
that tensor is large, a device-side flag saying whether it was finite). When a step's single
host read shows a non-finite loss or gradient, :meth:`Tracker.find` replays the step's forward
(and backward from the saved output gradient) once, with per-module finiteness hooks, before
the optimizer applies anything. Buffers (BatchNorm statistics), RNG state and ``inplace`` flags
are restored afterwards; ``.grad`` is never touched (the replayed backward uses
``torch.autograd.grad``).

What cannot be replayed exactly: forward passes with side effects or non-deterministic ops,
inputs modified in place after the forward, and models whose hooks refuse a second forward. If
the replay does not reproduce the non-finite values, the finding falls back to the cheap
attribution (the latest layer in model order with a non-finite gradient) and says so.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradwatch.layout import ROOT, unwrap
from gradwatch.probe import first_tensor

log = logging.getLogger("gradwatch")

#: output gradients up to this many elements are kept for the replay; larger ones are replaced
#: by a finite substitute (the birth place of a NaN in backward rarely depends on its values)
KEEP_GRAD_NUMEL = 1 << 22
#: forward calls per step kept for replay (gradient accumulation)
MAX_CAPTURES = 16


@dataclass
class Capture:
    """One forward call of the root module."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: list[torch.Tensor]
    grad: torch.Tensor | None = None
    grad_finite: torch.Tensor | None = None  # device flag when the gradient itself is not kept


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tensors, mappings, lists and tuples (a batch, a model's output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def finite(*objs: Any) -> bool:
    """Whether every floating-point tensor inside ``objs`` is finite (reads from the device)."""
    flags = [torch.isfinite(t).all() for o in objs for t in tensors(o) if t.is_floating_point() or t.is_complex()]
    return bool(torch.stack(flags).all()) if flags else True


def _collective(model: nn.Module) -> bool:
    """Whether the model's forward pass talks to other ranks (a replay on one rank would hang)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


class Tracker:
    """Keeps what a replay of the current step needs, and replays it on demand."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(unwrap(model))
        self.captures: list[Capture] = []
        self._cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    # ------------------------------------------------------------- every step
    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember a forward call: references to its inputs and the RNG state it starts from."""
        if len(self.captures) >= MAX_CAPTURES:
            self.captures.pop(0)
        self.captures.append(Capture(args, dict(kwargs), self._rng()))

    def output_grad(self, grad: torch.Tensor) -> None:
        """Remember the gradient arriving at the output of the latest forward call."""
        if not self.captures:
            return
        cap = self.captures[-1]
        if grad.numel() <= KEEP_GRAD_NUMEL:
            cap.grad = grad
        else:
            cap.grad_finite = torch.isfinite(grad).all()

    def clear(self) -> None:
        """Forget the step's forward calls."""
        self.captures = []

    def _rng(self) -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in self._cuda)]

    def _set_rng(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        for d, s in zip(self._cuda, states[1:]):
            torch.cuda.set_rng_state(s, d)

    # ------------------------------------------------------------ rare: replay
    def find(self, loss_finite: bool) -> dict[str, Any] | None:
        """Replay the step's forward calls until one reproduces a non-finite value.

        Returns:
            ``{"phase", "layer", "type", "how": "replayed", ...}``, or None when nothing could
            be replayed or the replay stayed finite (the caller then attributes cheaply).
        """
        model = self._model()
        if model is None or not self.captures:
            return None
        if _collective(model):  # replaying on this rank alone would wait forever for the others
            return {"how": "attributed", "note": "the step was not replayed: the model synchronises across ranks "
                                                 "in its forward pass (SyncBatchNorm)"}
        saved_rng = self._rng()
        with torch.no_grad():
            buffers = [(b, b.detach().clone()) for b in model.buffers()]
        inplace = [m for m in model.modules() if getattr(m, "inplace", None) is True]
        for m in inplace:
            setattr(m, "inplace", False)  # noqa: B010 - full backward hooks refuse in-place outputs
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PyTorch's notes about backward hooks on input-less modules
                for cap in self.captures:
                    found = self._replay(model, cap, loss_finite)
                    if found is not None:
                        return found
        except Exception as exc:  # a model that cannot be replayed: fall back, say why
            log.info("gradwatch: could not replay the step to find the NaN/Inf origin: %r", exc)
            return {"how": "attributed", "note": f"the step could not be replayed ({type(exc).__name__}: {exc})"}
        finally:
            for m in inplace:
                setattr(m, "inplace", True)  # noqa: B010
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            self._set_rng(saved_rng)
        return None

    def _replay(self, model: nn.Module, cap: Capture, loss_finite: bool) -> dict[str, Any] | None:
        names = {id(m): (name or ROOT) for name, m in model.named_modules()}
        forward: list[tuple[nn.Module, bool, bool]] = []
        backward: list[tuple[nn.Module, bool, bool]] = []

        def on_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            own = [p.detach() for p in module.parameters(recurse=False)]
            forward.append((module, finite(args, kwargs, own), finite(output)))

        def on_backward(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            backward.append((module, finite(grad_output), finite(grad_input)))

        def origin(phase: str, module: nn.Module | None, **extra: Any) -> dict[str, Any]:
            if module is None:
                return {"phase": phase, "layer": None, "how": "replayed", **extra}
            name, kind = names[id(module)], type(module).__name__
            return {"phase": phase, "layer": name, "type": kind, "how": "replayed", **extra}

        if not finite(cap.args, cap.kwargs):
            return origin("forward", None, source="input")
        modules = list(model.modules())
        handles = [m.register_forward_hook(on_forward, with_kwargs=True) for m in modules]
        handles += [m.register_full_backward_hook(on_backward) for m in modules]
        try:
            self._set_rng(cap.rng)
            with torch.enable_grad():
                output = model(*cap.args, **cap.kwargs)
            for module, inputs_ok, output_ok in forward:
                if inputs_ok and not output_ok:
                    return origin("forward", module)
            if not loss_finite:
                return origin("forward", None, source="loss")
            out = first_tensor(output)
            if out is None or not out.requires_grad:
                return None
            grad, note = cap.grad, None
            if grad is None:
                if cap.grad_finite is not None and not bool(cap.grad_finite):
                    return origin("backward", None, source="loss")
                grad, note = torch.ones_like(out), "replayed backward with a substitute output gradient"
            elif not finite(grad):
                return origin("backward", None, source="loss")
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(out, params, grad_outputs=grad, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        bad_params = {id(p) for p, g in zip(params, grads) if g is not None and not finite(g)}
        for module, grad_out_ok, grad_in_ok in backward:
            own_ok = not any(id(p) in bad_params for p in module.parameters(recurse=False))
            if grad_out_ok and not (grad_in_ok and own_ok):
                return origin("backward", module, **({"note": note} if note else {}))
        return None
