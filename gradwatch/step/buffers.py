"""Buffers: the model's buffers as they were before a step's forward passes, for a step that is not applied.

A forward pass changes buffers before any gradient exists: BatchNorm's running mean and variance
and its ``num_batches_tracked``, a running average kept as a buffer. When the step is then skipped
(or halted, or rolled back) a NaN batch has already poisoned them; parameters stay finite, yet
every output in eval mode is NaN. So at the first forward call of each step (before it runs) the
buffers that change are copied on their own device (one ``torch._foreach_copy_``, no host sync),
and a step that is not applied puts back the buffers its forward passes changed.

Which buffers are copied: every persistent buffer (those of the state dict: BatchNorm's statistics,
running averages; BatchNorm's kernel updates its statistics without bumping their version counter),
and a non-persistent one once its version counter shows it changing. The first step copies every
buffer; after it, a non-persistent constant (a causal mask, a rotary cache) is no longer copied.
So the copy costs one small device copy per step. A non-persistent buffer first seen changing in the
step that is not applied, or one replaced by another tensor, is not restored: the finding names it
(``buffers_changed``); one changed through ``.data`` (which bypasses the version counter) is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from gradwatch.step.layout import unwrap


class Buffers:
    """The copies of a model's changing buffers taken at the first forward call of each step."""

    def __init__(self) -> None:
        #: (the owning module's buffer dict, the buffer's name, its full name) of every buffer
        self._where: list[tuple[dict[str, Any], str, str]] = []
        self._model: weakref.ref[nn.Module] | None = None
        self._persistent: set[int] = set()
        self._live: list[torch.Tensor | None] = []  # the buffers at the last copy
        self._versions: list[int] = []
        self._copied: list[int] | None = None  # the buffers copied each step (None: not known yet: all)
        self._copies: dict[int, torch.Tensor] = {}
        #: the step the copies were taken for (None: no copy for a step yet)
        self.step: int | None = None

    def watch(self, model: nn.Module | None = None) -> None:
        """List the buffers of ``model`` (None: of the model watched already, again after its layout changed)."""
        if model is not None:
            self._model = weakref.ref(model)
        model = self._model() if self._model is not None else None
        if model is None:
            return
        inner = unwrap(model)
        where = [(module._buffers, name, f"{prefix}.{name}" if prefix else name,
                  name not in module._non_persistent_buffers_set)
                 for prefix, module in inner.named_modules()
                 for name, buf in module._buffers.items() if buf is not None]
        if [(id(d), n) for d, n, *_ in where] == [(id(d), n) for d, n, _ in self._where]:
            return  # the same buffers: the copies stand
        self._where = [(d, n, full) for d, n, full, _ in where]
        self._persistent = {i for i, (*_, persistent) in enumerate(where) if persistent}
        self._live, self._versions, self._copied, self._copies, self.step = [], [], None, {}, None

    def _current(self) -> list[torch.Tensor | None]:
        return [where.get(name) for where, name, _ in self._where]

    def _changed(self, live: list[torch.Tensor | None]) -> list[int]:
        """The buffers whose version counter moved (or that were replaced) since the last copy."""
        return [i for i, (buf, old, version) in enumerate(zip(live, self._live, self._versions))
                if buf is not None and (buf is not old or buf._version != version)]

    @torch.no_grad()
    def save(self, step: int) -> None:
        """The first forward call of ``step`` begins: copy the buffers that change (device copies only)."""
        if not self._where or torch.is_inference_mode_enabled():  # inference tensors have no version counter
            return
        live = self._current()
        if self._live:  # the buffers seen changing are copied from now on; a constant's first copy is dropped
            changed = set(self._changed(live))
            if self._copied is None or not changed.issubset(self._copied):
                self._copied = sorted(self._persistent.union(self._copied or (), changed))
                self._copies = {i: c for i, c in self._copies.items() if i in self._copied}
        dst, src = [], []
        for i in range(len(live)) if self._copied is None else self._copied:
            buf = live[i]
            if buf is None:
                continue
            copy = self._copies.get(i)
            if copy is None or copy.shape != buf.shape or copy.dtype != buf.dtype or copy.device != buf.device:
                copy = self._copies[i] = torch.empty_like(buf)
            dst.append(copy)
            src.append(buf)
        if dst:
            torch._foreach_copy_(dst, src)
        self._live = live
        self._versions = [buf._version if buf is not None else -1 for buf in live]
        self.step = step

    @torch.no_grad()
    def restore(self, step: int) -> dict[str, Any]:
        """``step`` is not applied: put back the buffers as they were before its forward calls.

        Returns what it did, for the finding: ``buffers_restored`` (how many), and ``buffers_changed``
        (the names of the buffers that changed and had no copy) where there are some.
        """
        if self.step != step or not self._where:  # no forward call of this step was seen
            return {}
        live = self._current()
        changed = self._changed(live)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, buf in enumerate(live):
            copy = self._copies.get(i)
            if buf is not None and buf is self._live[i] and copy is not None:
                dst.append(buf)
                src.append(copy)
        if dst:
            torch._foreach_copy_(dst, src)
        lost = [self._where[i][2] for i in changed if live[i] is not self._live[i] or i not in self._copies]
        if self._copied is not None:
            self._copied = sorted(set(self._copied).union(changed))  # copied from the next step on
        self._versions = [buf._version if buf is not None else -1 for buf in live]
        out: dict[str, Any] = {"buffers_restored": len(dst)}
        if lost:
            out["buffers_changed"] = lost
        return out

    def clear(self) -> None:
        """Drop every copy and reference (the run is closed)."""
        self._where, self._live, self._versions, self._copies, self.step = [], [], [], {}, None
