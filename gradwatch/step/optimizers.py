"""Optimizer discovery and closures: which optimizers step the watched parameters, and ``step(closure)``."""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: torch.optim's optimizers whose update divides by sqrt(v) + eps, v a running mean of squared gradients (RMSprop:
#: unless ``centered``); Adagrad's v is a running sum, which grows with the steps: not one of them
DIVIDING = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
            torch.optim.SparseAdam, torch.optim.RMSprop)


@dataclass
class Entry:
    """What one optimizer steps of the watched model."""

    count: int  # parameters the optimizer held when indexed
    indices: list[int]  # the watched parameters' indices that it holds
    groups: tuple[np.ndarray, ...] = ()  # the same, per param group


class Optimizers:
    """The optimizers seen stepping the watched parameters, indexed lazily at their first step.

    Args:
        params: the watched parameters, in layout order.
        grown: called when an optimizer's parameters changed (``add_param_group``), or one seen for the
            first time holds parameters the layout does not know beside watched ones: a sign that the
            model changed too (a new head, parameters unfrozen); it re-discovers the layout and calls
            :meth:`reindex` when it did. (An optimizer rebuilt with known parameters tells nothing new.)
        named: called with the sorted class names of the optimizers whenever a new one is seen.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, grown: Callable[[], None],
                 named: Callable[[list[str]], None]) -> None:
        self._grown = grown
        self._named = named
        self.reindex(params)

    def reindex(self, params: Sequence[torch.Tensor]) -> None:
        """A new layout: forget every optimizer's entry."""
        self._index = {id(p): i for i, p in enumerate(params)}
        self._entries: weakref.WeakKeyDictionary[torch.optim.Optimizer, Entry] = weakref.WeakKeyDictionary()

    def entry(self, opt: torch.optim.Optimizer) -> Entry | None:
        """What ``opt`` steps of the model; None when it holds none of the watched parameters."""
        count = sum(len(g["params"]) for g in opt.param_groups)
        entry = self._entries.get(opt)
        if entry is None or entry.count != count:
            held = [p for g in opt.param_groups for p in g["params"]]
            ours = [id(p) in self._index for p in held]
            if entry is not None or (any(ours) and not all(ours)):
                self._grown()  # param groups added, or new parameters: the model may have changed with them
            entry = Entry(count, [self._index[id(p)] for p in held if id(p) in self._index],
                          tuple(np.array([self._index[id(p)] for p in g["params"] if id(p) in self._index],
                                         dtype=np.int64) for g in opt.param_groups))
            known = opt in self._entries
            self._entries[opt] = entry
            if not known and entry.indices:
                self._named(sorted({type(o).__name__ for o in self.all()}))
        return entry if entry.indices else None

    def all(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping the model's parameters."""
        return [opt for opt, entry in list(self._entries.items()) if entry.indices]

    def adam_eps(self, size: int) -> np.ndarray | None:
        """Per watched parameter (``size`` of them), the ``eps`` of its param group in an optimizer whose update
        divides by sqrt(v) + eps; NaN for the others; None when no such optimizer steps the model.

        Those optimizers are torch.optim's Adam, AdamW, NAdam, RAdam, Adamax, SparseAdam and RMSprop (not
        ``centered``), and any other whose param groups hold both ``eps`` and ``betas`` (apex's FusedAdam,
        bitsandbytes' 8-bit Adam), except LAMB-type ones (the class name holds "lamb"), whose trust ratio rescales
        the update whatever eps does. An ``eps`` that is not a Python float (a tensor, a tuple as Adafactor's) is
        skipped. Plain Python on the param groups: no tensor is touched.
        """
        out = None
        for opt, entry in list(self._entries.items()):
            groups = opt.param_groups
            if not entry.indices or len(groups) != len(entry.groups) or not _dividing(opt):
                continue
            for group, idx in zip(groups, entry.groups):
                eps = group.get("eps")
                if not len(idx) or not isinstance(eps, float) or not math.isfinite(eps) or eps < 0 \
                        or group.get("centered"):
                    continue
                if out is None:
                    out = np.full(size, np.nan, dtype=np.float32)
                out[idx] = eps
        return out


def _dividing(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s update divides by sqrt(v) + eps (see :meth:`Optimizers.adam_eps`)."""
    if isinstance(opt, DIVIDING):
        return True
    group = opt.param_groups[0] if opt.param_groups else {}
    return "eps" in group and "betas" in group and "lamb" not in type(opt).__name__.lower()


def closure_at(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """Where ``optimizer.step(closure)`` holds its closure: ``"closure"`` (keyword), the index of
    the positional argument (the step pre-hook's ``args`` start with the optimizer itself), or None.
    """
    if callable(kwargs.get("closure")):
        return "closure"
    first = 1 if args and args[0] is opt else 0
    return first if len(args) > first and callable(args[first]) else None


def replace_closure(args: tuple[Any, ...], kwargs: dict[str, Any], at: int | str,
                    closure: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's arguments with the closure at ``at`` (from :func:`closure_at`) replaced."""
    if isinstance(at, str):
        return args, {**kwargs, at: closure}
    return (*args[:at], closure, *args[at + 1:]), kwargs


def measured_closure(closure: Callable[[], Any], *, evaluated: Callable[[Any], None],
                     aside: Callable[[Callable[[], Any]], Any], closed: Callable[[], bool]) -> Callable[[], Any]:
    """Wrap a step's closure so that the step is measured once its first evaluation has computed
    the gradients, before the optimizer uses them.

    Args:
        closure: the user's closure.
        evaluated: called with the first evaluation's loss (a one-element tensor, a number, or
            None when the closure returned neither): it measures, judges and acts on the step.
        aside: runs a later evaluation in the same step (an L-BFGS line search): the
            optimizer's business, not a new iteration.
        closed: whether the watcher has closed (every evaluation is then set aside).
    """
    calls = 0

    def measured() -> Any:
        nonlocal calls
        calls += 1
        if calls > 1 or closed():
            return aside(closure)
        loss = closure()
        scalar = (isinstance(loss, torch.Tensor) and loss.numel() == 1) or isinstance(loss, numbers.Real)
        evaluated(loss if scalar else None)
        return loss

    return measured
