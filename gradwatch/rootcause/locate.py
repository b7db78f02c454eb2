"""Locate (judge stage, rare path): the module where a NaN/Inf was born, by one replay with module hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradwatch.rootcause.capture import KEEP_GRADS, Capture
from gradwatch.rootcause.state import finite, first_tensor
from gradwatch.store.records import ROOT
from gradwatch.watching.parametrized import layers_of


@dataclass
class Located:
    """Where the first replay saw the NaN/Inf born.

    Attributes:
        phase: ``forward`` or ``backward``.
        module: the module (None when the input batch or the loss was the origin).
        name, kind: its path in the model and its class name.
        source: ``input`` (the batch) or ``loss`` when no module was the origin.
        call: which call of the module it was (0-based, in forward order; forward only).
        output: the module's output at that call (forward), or the model's output gradient
            (``source == "loss"``).
        grad_output: the gradient that arrived at the module (backward).
        bad_params: the module's own parameters whose gradient went non-finite (backward).
        note: what the replay had to assume.
    """

    phase: str
    module: nn.Module | None = None
    name: str | None = None
    kind: str | None = None
    source: str | None = None
    call: int = 0
    output: Any = None
    grad_output: tuple[Any, ...] = ()
    bad_params: list[str] = field(default_factory=list)
    note: str | None = None

    def origin(self) -> dict[str, Any]:
        """Today's module-level origin: ``phase``, ``layer``, ``type``, ``how`` (and ``source``, ``note``)."""
        out: dict[str, Any] = {"phase": self.phase, "layer": self.name, "how": "replayed"}
        if self.kind is not None:
            out["type"] = self.kind
        if self.source is not None:
            out["source"] = self.source
        if self.note is not None:
            out["note"] = self.note
        return out


def output_grad(cap: Capture, out: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """The gradient to replay the backward from: the step's own, or a substitute (with a note).

    Returns ``(None, None)`` when the step's output gradient itself was non-finite.
    """
    if cap.grad is not None:
        return cap.grad, None
    if cap.grad_finite is not None and not bool(cap.grad_finite):
        return None, None
    if not cap.grad_kept:
        return torch.ones_like(out), (f"replayed backward with a substitute output gradient (a small forward call "
                                      f"after the step's first {KEEP_GRADS} keeps no output gradient)")
    if cap.grad_none:
        return torch.ones_like(out), ("replayed backward with a substitute output gradient (none came back through "
                                      "the model's first output: the loss came through another one, as a compiled "
                                      "model's own loss does)")
    return torch.ones_like(out), "replayed backward with a substitute output gradient"


def locate(model: nn.Module, cap: Capture, loss_finite: bool) -> Located | None:
    """Replay one forward call (and its backward) with per-module finiteness hooks.

    Returns:
        where the NaN/Inf was born, or None when this replay stayed finite.
    """
    layers = layers_of(model)  # a parametrization's NaN/Inf is its parametrized module's
    calls: dict[int, int] = {}
    forward: list[tuple[nn.Module, int, bool, bool, Any]] = []
    backward: list[tuple[nn.Module, bool, bool, Any]] = []

    def on_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        own = [p.detach() for p in module.parameters(recurse=False)]
        n = calls.get(id(module), 0)
        calls[id(module)] = n + 1
        forward.append((module, n, finite(args, kwargs, own), finite(output), output))

    def on_backward(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        backward.append((module, finite(grad_output), finite(grad_input), grad_output))

    def at(phase: str, module: nn.Module, **extra: Any) -> Located:
        name, owner = layers[id(module)]
        return Located(phase, module, name or ROOT, type(owner).__name__, **extra)

    if not finite(cap.args, cap.kwargs):
        return Located("forward", source="input")
    modules = list(model.modules())
    handles = [m.register_forward_hook(on_forward, with_kwargs=True) for m in modules]
    handles += [m.register_full_backward_hook(on_backward) for m in modules]
    try:
        with cap.autocast.applied(), torch.enable_grad():
            output = model(*cap.args, **cap.kwargs)
        for module, call, inputs_ok, output_ok, out in forward:
            if inputs_ok and not output_ok:
                return at("forward", module, call=call, output=out)
        if cap.output is not None and not finite(cap.output):
            return None  # the step's own output was NaN/Inf, the replay's is finite: not reproduced
        if not loss_finite:
            note = None if cap.output is not None else "the step's own output was not kept (too large)"
            kept = cap.grad if cap.grad is not None and not finite(cap.grad) else None  # its rows name the samples
            return Located("forward", source="loss", note=note, output=kept)
        out = first_tensor(output)
        if out is None or not out.requires_grad:
            return None
        grad, note = output_grad(cap, out)
        if grad is None or not finite(grad):
            return Located("backward", source="loss", output=grad if grad is not None else cap.grad)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(out, [p for _, p in named], grad_outputs=grad, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    bad = {id(p): n for (n, p), g in zip(named, grads) if g is not None and not finite(g)}
    for module, grad_out_ok, grad_in_ok, grad_out in backward:
        own = [bad[id(p)] for p in module.parameters(recurse=False) if id(p) in bad]
        if grad_out_ok and not (grad_in_ok and not own):
            return at("backward", module, grad_output=tuple(grad_out), bad_params=own, note=note)
    return None
