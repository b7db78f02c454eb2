"""Activations (measure stage): what the leaf hooks of a sampled step collect, reduced in few launches.

A leaf's output is reduced to its L2 norm (every element), its number of non-zeros and, for a
bounded activation (tanh, sigmoid, softmax...), its number of saturated elements (both over the
elements :func:`gradwatch.step.stats.counted` picks). An output larger than :data:`BATCHED` elements is
reduced in its hook. Smaller ones are reduced together when the step reads them: one stack and
two or three row reductions for hundreds of calls, where three reductions per call cost three
launches each (a rollout of single-sample forward calls).

Until then a small output is held by reference with its version counter. A later op of the
forward pass may change it in place (an in-place ReLU after a Linear): the first sampled step
also copies every small output and learns which leaves' outputs are changed later; those are
copied in their hook from then on. Should a leaf start changing its output in place only later,
that call's values are left out of the step (its layer has fewer calls measured, or none: NaN),
and the leaf is copied from then on. Larger outputs are reduced in their hook: for them the stack's
copy costs about what the launches it saves do (measured on a deep narrow MLP's 8,192-element
outputs, batching them saves about 0.5 ms of a 5 ms sampled step).

A call that dynamo traces into a compiled graph (and every call of a model that was compiled before it
was watched) is summed on the device instead, per leaf (:class:`Slot`): the sum of its squared norms,
its counted elements, non-zeros and saturated ones, in one small tensor that the hook replaces. Such a
hook changes no Python state that dynamo would guard on — no list that grows with each call, no layer
index baked into the graph — so that one compiled frame serves every call: the same module class's
instances (the experts of a mixture, called one by one from a forward that fell back to eager), and
any number of forward calls per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradwatch.step.ranges import NARROW
from gradwatch.step.stats import activation_stats, saturated_rows, stacked, vector_norm

#: outputs of at most this many elements are reduced together when the step reads them (beyond it,
#: one launch per reduction costs about what stacking them does)
BATCHED = 16384
#: the copies kept before they are reduced (elements): bounded memory on a long forward pass
KEPT = 1 << 20


@dataclass
class Reduced:
    """Activation statistics of several leaf calls, one value per call in each tensor."""

    index: np.ndarray  # the layer of each call (int64)
    counted: np.ndarray  # the number of elements each call's counts are of (float64)
    #: 1-D float32 tensors whose values, in order, are one per call (one tensor unless the calls
    #: ran on several devices)
    norms: list[torch.Tensor]
    nonzeros: list[torch.Tensor]
    bounded: np.ndarray  # bool: the call has a saturated count
    saturated: list[torch.Tensor]  # one value per bounded call
    #: the counted elements of the calls whose ``counted`` is NaN (summed on the device: :class:`Slot`),
    #: in order, as 1-D float32 tensors
    counts: list[torch.Tensor] = field(default_factory=list)
    #: how each call's norm was taken (None: all in float32): :data:`WIDE` in float64, :data:`EXACT` scaled
    how: np.ndarray | None = None
    #: the leaves measured scaled from now on (the collector's, which the host's read adds to)
    scaled: set[int] | None = None


#: a call's norm was a float64 sum of squares (a float64 or complex128 output)
WIDE = 1
#: a call's norm was taken scaled (:func:`gradwatch.step.ranges.scaled_norms`): right at any scale
EXACT = 2


def outputs(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The floating-point and complex tensors of a module's output, in order: the output itself, those
    inside a named tuple, dict (a ``ModelOutput``) or dataclass, however nested — each field a named output
    — and of a plain tuple or list the first that holds one: ``(output, state)`` by convention (an RNN's
    ``h_n`` is its output's last step and ``c_n`` its memory, ``MultiheadAttention``'s second its weights).
    """
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() or output.is_complex() else []
    if depth > 8:
        return []
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        return next((found for item in output if (found := outputs(item, depth + 1))), [])
    if isinstance(output, dict):
        items: Any = output.values()
    elif isinstance(output, tuple):  # a named tuple
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name, None) for f in dataclasses.fields(output)]
    else:
        return []
    return [t for item in items for t in outputs(item, depth + 1)]


def _how(out: torch.Tensor) -> int:
    return WIDE if out.dtype in (torch.float64, torch.complex128) else 0


def _why(exc: Exception) -> str:
    """An error in a few words (its type and first line)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200]


class Slot:
    """One leaf's statistics on a sampled step, summed on the device: ``sums`` is None until its first
    call, then a 1-D tensor [sum of squared norms, counted elements, non-zeros, saturated] that each
    call replaces with the sum (nothing else of Python changes: a traced hook is guarded on nothing that
    differs from one call, or one leaf of the same kind, to the next).
    """

    __slots__ = ("index", "limits", "sums")

    def __init__(self, index: int, limits: tuple[float, float] | None) -> None:
        self.index, self.limits = index, limits
        self.sums: torch.Tensor | None = None


class Collected:
    """The activation statistics of the leaf calls since the last :meth:`take`."""

    def __init__(self) -> None:
        #: leaves whose small outputs are changed in place after their hook: copied there
        self.copied: set[int] = set()
        #: the stacks' memory, kept from one sampled step to the next by (size, dtype): a fresh
        #: allocation of megabytes each step page-faults (glibc maps it anew), a reused one does not
        self._rows: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        #: leaves whose small outputs are known to stay as they are until the step: held
        self.held: set[int] = set()
        #: one per leaf (:meth:`made`), for the calls summed on the device
        self.slots: list[Slot] = []
        #: some slot has sums (set by a call, which never reads it: nothing for dynamo to guard on)
        self.summed = False
        #: leaves whose norms did not fit a float32 (or float64) sum of squares: measured scaled in their hook
        self.scaled: set[int] = set()
        #: leaves whose statistics torch could not compute, with why: left out from then on, said once
        self.failed: dict[int, str] = {}
        self.clear()

    def clear(self) -> None:
        """Forget everything collected."""
        self.done: list[Reduced] = []
        #: calls reduced one by one: leaf, statistics, counted elements, how the norm was taken
        self._one: list[tuple[int, list[torch.Tensor], int, int]] = []
        #: small outputs by (shape, dtype, output range of a bounded activation): each call's leaf,
        #: its output (or a copy) and the output's version counter when held (-1: a copy)
        self._small: dict[tuple[torch.Size, torch.dtype, tuple[float, float] | None],
                          tuple[list[int], list[torch.Tensor], list[int], list[torch.Tensor | None]]] = {}
        self._kept = 0
        #: leaves whose output a forward call outside a backward pass gave (see :meth:`add`'s ``recomputed``)
        self._forward: set[int] = set()
        if self.summed:
            self.summed = False
            for slot in self.slots:
                slot.sums = None

    def made(self, leaves: list[tuple[int, tuple[float, float] | None]]) -> list[Slot]:
        """The slots of these leaves (index, output bounds), in place of any earlier ones (and their sums)."""
        self.slots, self.summed = [Slot(index, limits) for index, limits in leaves], False
        return self.slots

    def accumulate(self, slot: Slot, out: torch.Tensor) -> None:
        """A leaf call's output, summed on the device into its slot (a call traced into a compiled graph)."""
        values, counted = activation_stats(out, slot.limits)
        dtype = torch.float32 if out.device.type == "mps" else torch.float64  # MPS has no float64
        norm = values[0].to(dtype)
        sums = torch.stack([norm * norm, torch.full((), counted, dtype=dtype, device=norm.device),
                            values[1].to(dtype), values[2].to(dtype) if len(values) == 3 else torch.zeros_like(norm)])
        before = slot.sums
        slot.sums = sums if before is None else before + sums.to(before.device)
        self.summed = True

    def add(self, index: int, out: torch.Tensor, limits: tuple[float, float] | None, recomputed: bool = False) -> None:
        """A leaf call's output (reduced now when large or on an accelerator, else with the others of its shape).

        ``recomputed``: the call runs inside a backward pass, activation checkpointing recomputing a segment.
        Its outputs are counted once: skipped when the leaf's forward call gave them already (``use_reentrant=
        False``), taken when it ran without gradients and was not measured (``use_reentrant=True``).
        """
        if recomputed and index in self._forward or index in self.failed:
            return
        if not recomputed:
            self._forward.add(index)
        n = out.numel()
        scaled = index in self.scaled
        if n > BATCHED or not out.is_cpu or scaled or out.dtype not in NARROW and out.dtype != torch.float64:
            try:
                values, counted = activation_stats(out, limits, scaled)
            except Exception as exc:  # a dtype or layout torch does not reduce: this leaf is left out
                self.failed[index] = _why(exc)
                return
            self._one.append((index, values, counted, EXACT if scaled else _how(out)))
            return
        indices, outs, versions, copies = self._small.setdefault((out.shape, out.dtype, limits), ([], [], [], []))
        indices.append(index)
        if index in self.held and not out.is_inference():  # an inference tensor keeps no version: copied
            outs.append(out)
            versions.append(out._version)
            copies.append(None)
        else:
            copy = out.detach().clone()
            learn = index not in self.copied and not out.is_inference()  # inference tensors keep no version
            outs.append(out if learn else copy)
            versions.append(out._version if learn else -1)
            copies.append(copy)
        self._kept += n
        if self._kept > KEPT:
            self._reduce_small()

    def _reduce_small(self) -> None:
        if not self._small:
            return
        # the step may run under the loop's autocast; a reduction in a hook must not record autograd
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            self._reduce_small_now()

    def _reduce_small_now(self) -> None:
        for (shape, _, limits), (indices, outs, versions, copies) in self._small.items():
            rows_of: list[torch.Tensor] = []
            kept = []
            for index, out, version, copy in zip(indices, outs, versions, copies):
                if version >= 0:  # held: is it as it was in the hook?
                    same = out._version == version
                    if copy is None and not same:  # a held leaf changed its output: lost for this call
                        self.held.discard(index)
                        self.copied.add(index)
                        continue
                    if copy is not None:  # learning: hold it from now on, or copy it
                        (self.held if same else self.copied).add(index)
                rows_of.append(copy if copy is not None else out)
                kept.append(index)
            if not kept:
                continue
            try:
                self._reduce_rows(kept, rows_of, shape, limits)
            except Exception:  # some leaf's outputs cannot be reduced so: each call on its own
                for index, out in zip(kept, rows_of):
                    if index in self.failed:
                        continue
                    try:
                        values, counted = activation_stats(out, limits)
                    except Exception as exc:
                        self.failed[index] = _why(exc)
                        continue
                    self._one.append((index, values, counted, _how(out)))
        self._small, self._kept = {}, 0

    def _reduce_rows(self, indices: list[int], rows_of: list[torch.Tensor], shape: torch.Size,
                     limits: tuple[float, float] | None) -> None:
        """One group's calls (same shape and type) as the rows of a matrix, reduced together."""
        rows, nonzero = self._stacked(rows_of, shape)
        self.done.append(Reduced(
            np.asarray(indices, dtype=np.int64), np.full(len(indices), float(rows.shape[1])),
            [vector_norm(rows, dim=1)],
            [nonzero.sum(1, dtype=torch.int32).float()],  # int32: 2.4x faster than int64 on a CPU
            np.full(len(indices), limits is not None),
            [saturated_rows(rows, limits).float()] if limits is not None else [],
            how=np.full(len(indices), WIDE, dtype=np.int8) if _how(rows) else None, scaled=self.scaled))

    def _stacked(self, outs: list[torch.Tensor], shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs as the rows of a matrix, and whether each element is non-zero, in reused memory."""
        k, n, dtype = len(outs), shape.numel(), outs[0].dtype
        rows, nonzero = self._rows.get((n, dtype), (None, None))
        if rows is None or nonzero is None or rows.shape[0] < k:
            rows = torch.empty((k, n), dtype=dtype)  # at most KEPT elements (and as many bytes of flags)
            nonzero = torch.empty(rows.shape, dtype=torch.bool)
            self._rows[(n, dtype)] = (rows, nonzero)
        rows, nonzero = rows[:k], nonzero[:k]
        torch.stack(outs, out=rows.view(k, *shape))
        nonzero.copy_(rows)  # a cast to bool: NaN counts as non-zero (4x faster than comparing with 0)
        return rows, nonzero

    def take(self) -> list[Reduced]:
        """Hand over the statistics collected so far and start anew."""
        self._reduce_small()
        if self._one:
            one = self._one
            bounded = np.fromiter((len(values) == 3 for _, values, _, _ in one), dtype=bool, count=len(one))
            sat = [values[2] for _, values, _, _ in one if len(values) == 3]
            how = np.fromiter((h for _, _, _, h in one), dtype=np.int8, count=len(one))
            self.done.append(Reduced(
                np.fromiter((i for i, _, _, _ in one), dtype=np.int64, count=len(one)),
                np.fromiter((c for _, _, c, _ in one), dtype=np.float64, count=len(one)),
                stacked([values[0] for _, values, _, _ in one]), stacked([values[1] for _, values, _, _ in one]),
                bounded, stacked(sat), how=how if how.any() else None, scaled=self.scaled))
        if self.summed:
            self._take_sums()
        taken = self.done
        self.clear()
        return taken

    def _take_sums(self) -> None:
        """The slots' sums as one row per leaf called (one :class:`Reduced` per device)."""
        by_device: dict[torch.device, list[Slot]] = {}
        for slot in self.slots:
            if slot.sums is not None:
                by_device.setdefault(slot.sums.device, []).append(slot)
        for slots in by_device.values():
            sums = torch.stack([slot.sums for slot in slots])  # type: ignore[misc]
            bounded = np.fromiter((slot.limits is not None for slot in slots), dtype=bool, count=len(slots))
            self.done.append(Reduced(
                np.fromiter((slot.index for slot in slots), dtype=np.int64, count=len(slots)),
                np.full(len(slots), np.nan), [sums[:, 0].sqrt()], [sums[:, 2].float()], bounded,
                [torch.stack([slot.sums[3] for slot in slots if slot.limits is not None]).float()]  # type: ignore[index]
                if bounded.any() else [],
                [sums[:, 1].float()]))
