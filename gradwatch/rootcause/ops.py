"""Ops (judge stage, rare path): the first aten op whose output is NaN/Inf while its inputs were not.

A ``TorchDispatchMode`` is entered only during the second replay of the anomalous step, only
around the origin module's call (and, when nothing inside it was born, from there to the end of
the forward). An op "gives birth" when its inputs, scalars included, are all finite and its
output is not, or when its inputs hold no NaN and its output does (softmax over an all ``-inf``
row: ``-inf`` from a mask is meant, the NaN is not). Ops that allocate without writing
(``empty``) are never blamed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradwatch.rootcause import facts
from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.frames import Line, user_line
from gradwatch.rootcause.locate import Located
from gradwatch.rootcause.state import Rng, floats, stored
from gradwatch.store.records import ROOT
from gradwatch.watching.parametrized import layers_of

#: ops that allocate memory without writing it, or only move it: never the birth place
UNWRITTEN = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                       "alias", "lift_fresh", "_local_scalar_dense", "set_", "resize_", "resize_as_"})
#: ops checked at most per replay (each costs a host read): the search is bounded
MAX_OPS = 20_000


@dataclass
class Born:
    """The op that gave birth to the first NaN/Inf.

    Attributes:
        op: the aten op (``aten::log``).
        phase: ``forward`` or ``backward``.
        layer: the module it ran in.
        what: ``NaN`` or ``Inf`` (what its output held).
        fact: what about its inputs explains it.
        line: the source line that ran it.
        rows: a tensor whose non-finite rows are the samples' (its output, or the gradient it made).
        node: the autograd node (backward).
        param: the parameter whose gradient it made non-finite (backward).
        scores: for a parameter's gradient, how much each row of the batch puts into it
            (``|x_i| |g_i|`` of a matrix product's input and incoming gradient), in float64.
        weightless: the input values that made it carry no trainable weight (computed from the
            batch, constants and frozen weights alone; forward only, see :func:`facts.weightless`).
        culprit: what in its inputs made it, in a few words (``a 0 in the input of log``; forward only).
    """

    op: str
    phase: str
    layer: str | None
    what: str
    fact: str
    line: Line | None
    rows: torch.Tensor | None = None
    node: str | None = None
    param: str | None = None
    scores: torch.Tensor | None = None
    weightless: bool = False
    culprit: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The plain data of a finding's ``root_cause``."""
        out: dict[str, Any] = {"op": self.op, "phase": self.phase, "layer": self.layer, "born": self.what,
                               "fact": self.fact}
        out.update(self.line.to_json() if self.line is not None else {"file": None, "line": None, "code": None})
        if self.node is not None:
            out["node"] = self.node
        if self.param is not None:
            out["param"] = self.param
        return out


def _scalars_finite(obj: Any) -> tuple[bool, bool]:
    """(no NaN, all finite) over the plain numbers inside an op's arguments."""
    nums = [x for x in _flat(obj) if isinstance(x, float)]
    return not any(math.isnan(x) for x in nums), all(math.isfinite(x) for x in nums)


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [y for x in obj for y in _flat(x)]
    if isinstance(obj, dict):
        return [y for x in obj.values() for y in _flat(x)]
    return [obj]


def _flags(ts: list[torch.Tensor]) -> torch.Tensor:
    """[any NaN, any non-finite] over tensors, launched on the device (read later)."""
    if not ts:
        return torch.zeros(2, dtype=torch.bool)
    return torch.stack([torch.stack([torch.isnan(v).any(), ~torch.isfinite(v).all()])
                        for v in map(stored, ts)]).any(0).cpu()


class Ops(TorchDispatchMode):
    """Records the aten ops that run under it; with ``check``, finds the first one that gives birth.

    Attributes:
        names: the aten op names run so far (``_softmax``, ``addmm``...).
        born: the first op that gave birth (``check`` only).
        layer: the module path to report ops under.
    """

    def __init__(self, check: bool, layer: str | None = None) -> None:
        super().__init__()
        self.check, self.layer = check, layer
        self.names: list[str] = []
        self.born: Born | None = None
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.names.append(name)
        if not self.check or self.born is not None or name in UNWRITTEN or self.count >= MAX_OPS:
            return func(*args, **kwargs)
        self.count += 1
        ins = floats((args, kwargs))
        before = _flags(ins)
        mutable = func._schema.is_mutable
        kept = [a.clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args] \
            if mutable else list(args)
        out = func(*args, **kwargs)
        outs = floats(out)
        if not outs:
            return out
        after = _flags(outs)
        no_nan, all_finite = _scalars_finite((args, kwargs))
        in_nan, in_bad = bool(before[0]) or not no_nan, bool(before[1]) or not all_finite
        out_nan, out_bad = bool(after[0]), bool(after[1])
        if (out_bad and not in_bad) or (out_nan and not in_nan):
            first = next(t for t in outs if not bool(torch.isfinite(stored(t)).all()))
            self.born = Born(op=str(func._schema.name), phase="forward", layer=self.layer,
                             what="NaN" if out_nan else "Inf", fact=facts.forward(name, func, kept, kwargs, first),
                             line=user_line(), rows=first, weightless=facts.weightless(name, args),
                             culprit=facts.culprit(name, kept))
        return out


class _Stop(BaseException):
    """Ends a replay's forward once the birth place is known (not an ``Exception``: a model's own
    ``except Exception`` cannot swallow it).
    """


def search(model: nn.Module, cap: Capture, located: Located, rng: Rng) -> tuple[Born | None, dict[str, Any]]:
    """Replay the forward call again, with :class:`Ops` from the origin module's call on.

    The mode checks the ops of the origin module's call (the one the first replay saw go
    non-finite); when none of them gave birth (a module whose ``-inf`` output was meant, like
    a mask), it goes on checking until the end of the forward.

    Returns:
        the op (None when none gave birth), and the origin module's call: its ``args``,
        ``kwargs`` and the ``rng`` state it started from.
    """
    assert located.module is not None
    target, names = located.module, {k: (n or ROOT) for k, (n, _) in layers_of(model).items()}
    stack: list[str] = []
    calls = [0]
    call: dict[str, Any] = {}
    mode = Ops(check=True)

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        stack.append(names[id(module)])
        mode.layer = stack[-1]
        if module is target and not call:
            calls[0] += 1
            if calls[0] - 1 == located.call:
                call.update(args=args, kwargs=kwargs, rng=rng.get())
                mode.__enter__()

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        stack.pop()
        if stack:
            mode.layer = stack[-1]
        if call and mode.born is not None:
            raise _Stop

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(post, with_kwargs=True) for m in model.modules()]
    try:
        rng.set(cap.rng)
        with cap.autocast.applied(), torch.enable_grad():
            model(*cap.args, **cap.kwargs)
    except _Stop:
        pass
    finally:
        if call:
            mode.__exit__(None, None, None)
        for h in handles:
            h.remove()
    return mode.born, call
