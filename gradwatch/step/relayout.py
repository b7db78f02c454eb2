"""Relayout (open stage): the watched model's parameters change while it trains, and the layout follows.

A layer added or replaced, or parameters frozen or unfrozen after ``gw.watch`` (a fine-tuning loop
that unfreezes its backbone), change which parameters there are and which are trained: the
detectors judge a parameter that requires grad and gets none (``unused_parameter``), or one that
gets a gradient and is not updated (``unoptimized_parameter``), by the layout. Looking costs one
re-discovery of the model, so it is done when there is a sign, never by a scan per step:

- a submodule or a parameter set on a module of the model (a head replaced, weights tied,
  ``load_state_dict(assign=True)``, pruning's ``weight_orig``), told by torch's global registration
  hooks (:class:`Changes`): looked at before the next forward call or optimizer step;
- an optimizer seen for the first time, or one whose param groups changed (``add_param_group``)
  (:class:`gradwatch.step.optimizers.Optimizers`);
- a parameter whose ``requires_grad`` changed (:class:`Trainable`), seen where its gradient became
  zero or absent (or came back) and on every sampled step: a new version of the same layout;
- the parameters without a gradient are not those of the last look (and the first step).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import replace

import numpy as np
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.errors import ConfigError
from gradwatch.step.layout import Discovered, discover, eps
from gradwatch.watching import register
from gradwatch.watching.guard import Guard


def rediscovered(model: nn.Module, found: Discovered) -> Discovered | None:
    """The model's layout now (the next version), or None when it is ``found``'s: the same layers, the
    same parameter objects under the same names, the same of them requiring grad, of dtypes with the
    same machine epsilons; None also while every parameter is frozen (the layout stays as it was).
    """
    try:
        now = discover(model, version=found.layout.version + 1)
    except ConfigError:
        return None
    same = (now.layout.layers, now.layout.params, now.layout.trainable, now.layout.eps) == (
        found.layout.layers, found.layout.params, found.layout.trainable, found.layout.eps)
    if same and all(a is b for a, b in zip(now.params, found.params)):
        return None
    if [(i, id(m)) for i, m in now.leaf_modules] == [(i, id(m)) for i, m in found.leaf_modules]:
        now.leaf_modules = found.leaf_modules  # the same leaves: their hooks, and what they collected, stand
    before, after = _owned(found), _owned(now)
    now.layout = replace(now.layout, renewed=tuple(
        i for i, name in enumerate(now.layout.layers) if name in after and after[name] != before.get(name)))
    return now


def _owned(found: Discovered) -> dict[str, list[tuple[int, int]]]:
    """Per layer owning parameters, its parameters' identities and how many layers own each (tied: more)."""
    owners = Counter(p for _, p in found.layout.owners)
    out: dict[str, list[tuple[int, int]]] = {}
    for layer, p in found.layout.owners:
        out.setdefault(found.layout.layers[layer], []).append((id(found.params[p]), owners[p]))
    return out


class Looks:
    """When to look at the layout again: at the first step, then when the parameters without a
    gradient are not those of the last look, at most once per ``period`` steps.
    """

    def __init__(self, period: int) -> None:
        self.period = period
        self._missing: tuple[int, ...] | None = None
        self._at = -period

    def looked(self, step: int) -> None:
        """The model was looked at on ``step`` for another sign (an optimizer's): the next look waits its period."""
        self._at = step

    def due(self, missing: tuple[int, ...], step: int) -> bool:
        """Whether to look now, given the parameters (indices) without a gradient at the latest step."""
        if missing == self._missing or step < self._at + self.period:
            return False
        self._missing, self._at = missing, step
        return True


class Changes:
    """Registrations into the watched model: a submodule or parameter set on one of its modules, other
    than the one it holds there already, marks the layout ``dirty`` (one set lookup per registration
    anywhere in the process; nothing per step).

    Args:
        found: the layout whose modules are the model's.
        guard: the watcher's guard (torch's global registration hooks run through it).
    """

    def __init__(self, found: Discovered, guard: Guard) -> None:
        self.dirty = False
        self._members: weakref.WeakSet[nn.Module] = found.modules
        self._handles: list[RemovableHandle] = register.registrations(guard.hook("registration", self._registered))

    def follow(self, found: Discovered) -> None:
        """The model was looked at: ``found`` is its layout now (its modules are the watched ones)."""
        self._members = found.modules
        self.dirty = False

    def _registered(self, module: nn.Module, name: str, value: object) -> None:
        if self.dirty or module not in self._members:
            return
        held = module._modules.get(name) if isinstance(value, nn.Module) else module._parameters.get(name)
        self.dirty = held is not value

    def close(self) -> None:
        """Stop listening (the watcher detaches)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class Trainable:
    """Which parameters require grad, followed without a scan per step: a parameter whose gradient became
    exactly zero or absent, or came back (frozen, unfrozen), is asked; a sampled step lists them anyway.
    """

    def __init__(self) -> None:
        self._still = np.zeros(0, dtype=bool)

    def now(self, found: Discovered, grads: np.ndarray | None, listed: list[int] | None) -> tuple[bool, ...] | None:
        """Which parameters require grad now, when it is not what ``found`` says; else None.

        Args:
            found: the layout in use.
            grads: the step's gradient norm per parameter (NaN: no gradient), or None.
            listed: the indices of the parameters that require grad, when the step listed them (sampled).
        """
        trainable = found.layout.trainable
        if listed is not None:
            now = np.zeros(len(found.params), dtype=bool)
            now[listed] = True
            return tuple(now.tolist()) if not np.array_equal(now, trainable) else None
        if grads is None or len(grads) != len(trainable):
            return None
        still = ~(np.abs(grads) > 0)  # exactly zero, or no gradient
        changed = np.flatnonzero(still != self._still) if len(self._still) == len(still) else np.flatnonzero(still)
        self._still = still
        params = found.params
        if all(params[i].requires_grad == trainable[i] for i in changed):
            return None
        return tuple(p.requires_grad for p in params)

    @staticmethod
    def cast(found: Discovered) -> bool:
        """Whether a parameter's dtype changed since ``found`` was discovered (``.half()``, ``.double()`` of a
        module cast its parameters in place): one attribute per parameter, asked on sampled steps.
        """
        kept = found.layout.eps
        return len(kept) == len(found.params) and any(eps(p.dtype) != e for p, e in zip(found.params, kept))
