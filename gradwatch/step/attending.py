"""Attending (measure stage): the attention calls of a sampled step's forward passes, by layer, read with the step.

A sampled step's forward call (eager, in the watching thread) runs with :class:`~gradwatch.step.attention.Watching`
on torch's function-mode stack, from the root's forward pre-hook to its forward hook (one that runs even
when the forward raises). Each attention call adds one small tensor to its layer's list; the step takes
them (:meth:`Attending.take`), reads them with everything else in its one host read, and records per layer
(the module that runs the call, :func:`~gradwatch.step.attention.calling_module`), on that sampled step:

- ``attn_logit_max/<layer>``: the largest attention logit of any head (the largest over the step's calls; of
  calls with different numbers of heads, those with the most);
- ``attn_logit_head/<layer>``: the head that holds it (its index; 0 where the heads are not told apart);
- ``attn_entropy/<layer>``: the lowest mean attention entropy (nats) of any head (the mean over the calls);
- ``attn_entropy_head/<layer>``: that head.

A layer whose statistics torch cannot compute is left out from then on, said once (``unmeasured``). After
``QUIET_AFTER`` sampled forward calls in a row without an attention call, the mode stays off the stack (a CNN
or an MLP pays nothing) until the model changes.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.step import attention
from gradwatch.store.findings import Finding
from gradwatch.store.records import ATTN_ENTROPY, ATTN_ENTROPY_HEAD, ATTN_LOGIT_HEAD, ATTN_LOGIT_MAX, ROOT, layer_scalar
from gradwatch.watching import register
from gradwatch.watching.guard import Guard

#: sampled forward calls in a row without an attention call after which the mode stays off the stack (a model with
#: no attention pays nothing) until the model changes (:meth:`Attending.renew`)
QUIET_AFTER = 3


class Attending:
    """The attention statistics of one watched model's sampled forward calls."""

    def __init__(self, model: nn.Module, guard: Guard) -> None:
        self._model = weakref.ref(model)  # an unwatched model is freed, whatever still holds its watcher's parts
        self._mode = attention.Watching(guard.hook("attention", self._seen))
        self._end = guard.hook("attention_end", self._ended)
        self._handle: RemovableHandle | None = None
        #: the mode is on the stack, under a mode pushed after it that is still there: taken off when it can be
        self._stranded = False
        #: a sampled forward call runs (the mode measures only then)
        self._on = False
        #: sampled forward calls in a row that made no attention call; the calls seen in the one running
        self._none, self._made = 0, 0
        self._names: dict[int, str] | None = None
        #: each layer's calls since the last take: one tensor each (see :func:`gradwatch.step.attention.stats`)
        self.calls: dict[str, list[torch.Tensor]] = {}
        #: layers whose statistics torch could not compute, with why (left out from then on)
        self.failed: dict[str, str] = {}
        self._said: set[str] = set()
        #: a call outside any forward of the watched model (an attention call made in a backward pass) is none
        self.skip: Any = None

    def begin(self) -> None:
        """A sampled forward call begins: watch its attention calls until it ends."""
        if self._handle is not None or self._none >= QUIET_AFTER:
            return
        self._names = None  # the model as it is now (a head swapped since the last sampled step)
        if self._stranded:
            self._stranded = not register.pop_mode(self._mode)
        model = self._model()
        if model is None:
            return
        if not self._stranded:
            register.push_mode(self._mode)
        self._handle = register.forward(model, self._end, always_call=True)
        self._on, self._made = True, 0

    def _ended(self, module: nn.Module, args: Any, output: Any) -> None:
        self.end()

    def end(self) -> None:
        """The forward call ended (or the watch closes): the mode leaves the stack, if it is on top."""
        handle, self._handle = self._handle, None
        self._on = False
        if handle is None:
            return
        self._none = 0 if self._made else self._none + 1
        handle.remove()
        if not self._stranded:
            self._stranded = not register.pop_mode(self._mode)

    def renew(self) -> None:
        """The model changed (a submodule set, a layer swapped): look for attention calls again."""
        self._none = 0

    def close(self) -> None:
        """The watch closes: the mode leaves the stack (if it was left under another mode, when that one left)."""
        self.end()
        if self._stranded:
            self._stranded = not register.pop_mode(self._mode)

    def _seen(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Any) -> None:
        if not self._on or (self.skip is not None and self.skip()):
            return
        model = self._model()
        if model is None:
            return
        if self._names is None:
            self._names = attention.module_names(model, ROOT)
        layer = attention.calling_module(self._names, frame)
        if layer is None or layer in self.failed:
            return
        try:
            values = attention.measure(kind, args, kwargs)
        except Exception as exc:  # a dtype, layout or shape torch does not reduce so: this layer is left out
            text = str(exc).splitlines()[0] if str(exc) else ""
            self.failed[layer] = f"{type(exc).__name__}: {text}"[:200]
            self._made += 1
            return
        if values is not None:  # an attention call (a softmax over anything else is none)
            self._made += 1
            self.calls.setdefault(layer, []).append(values)

    def take(self) -> list[tuple[str, torch.Tensor]]:
        """Each layer's statistics since the last take, one tensor per layer: per head the largest logit
        of its calls, then the mean of their entropies; of calls with different numbers of heads (a module
        that also makes a single-head softmax), those with the most heads; nothing is read here.
        """
        calls, self.calls = self.calls, {}
        out = []
        for layer, values in calls.items():
            size = max(v.numel() for v in values)
            same = torch.stack([v for v in values if v.numel() == size]) if len(values) > 1 else values[0][None]
            heads = size // 2
            out.append((layer, torch.cat([same[:, :heads].amax(0), same[:, heads:].mean(0)])))
        return out

    @staticmethod
    def scalars(taken: list[tuple[str, torch.Tensor]], host: np.ndarray) -> dict[str, float]:
        """The attention scalars (``attn_*``: see :data:`gradwatch.store.records.ATTN_LOGIT_MAX`) of what
        :meth:`take` gave, from ``host``: their values, in order.
        """
        out: dict[str, float] = {}
        k = 0
        for layer, values in taken:
            n = values.numel()
            heads = n // 2
            largest, entropy = host[k:k + heads], host[k + heads:k + n]
            k += n
            if not len(largest) or np.isnan(largest).all():
                continue
            top = int(np.nanargmax(largest))
            out[layer_scalar(ATTN_LOGIT_MAX, layer)] = float(largest[top])
            out[layer_scalar(ATTN_LOGIT_HEAD, layer)] = float(top)
            if not np.isnan(entropy).all():
                low = int(np.nanargmin(entropy))
                out[layer_scalar(ATTN_ENTROPY, layer)] = float(entropy[low])
                out[layer_scalar(ATTN_ENTROPY_HEAD, layer)] = float(low)
        return out

    def findings(self, step: int) -> list[Finding]:
        """The ``unmeasured`` findings (info) of the layers left out, each said once."""
        out = []
        for layer, why in self.failed.items():
            if layer in self._said:
                continue
            self._said.add(layer)
            out.append(Finding(
                kind="unmeasured", severity="info", step=step, layer=layer,
                message=f"gradwatch cannot compute `{layer}`'s attention logits ({why}): they are left out for "
                        "this layer from now on; everything else is watched.",
                data={"metric": ATTN_LOGIT_MAX, "why": why}))
        return out
