"""Activations (measure stage): what the leaf hooks of a sampled step collect, reduced in few launches.

A leaf's output is reduced to its L2 norm (every element), its number of non-zeros and, for a
bounded activation, its number of saturated elements (both over the elements
:func:`gradwatch.stats.counted` picks). An output larger than :data:`BATCHED` elements is reduced
in its hook. A smaller one is copied there (a later op of the forward pass may change the output
in place) and the copies of one size are reduced together when the step reads them: one stack and
two row reductions for hundreds of calls, where three reductions per call cost three launches
each (a rollout of single-sample forward calls). Larger ones are not worth a copy: measured on
the 8,192-element outputs of a deep narrow MLP, copying and stacking cost more than reducing each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradwatch.stats import activation_stats, stacked

#: outputs of at most this many elements are copied and reduced together (beyond it, one launch per
#: reduction costs less than the copies)
BATCHED = 2048
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


class Collected:
    """The activation statistics of the leaf calls since the last :meth:`take`."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything collected."""
        self.done: list[Reduced] = []
        self._one: list[tuple[int, list[torch.Tensor], int]] = []
        self._small: dict[tuple[int, torch.dtype, torch.device], tuple[list[int], list[torch.Tensor]]] = {}
        self._kept = 0

    def add(self, index: int, out: torch.Tensor, limits: tuple[float, float] | None, *, here: bool) -> None:
        """A leaf call's output (``here``: reduce it now, as in a compiled graph)."""
        n = out.numel()
        if here or limits is not None or n > BATCHED or out.device.type != "cpu":
            values, counted = activation_stats(out, limits)
            self._one.append((index, values, counted))
            return
        indices, copies = self._small.setdefault((n, out.dtype, out.device), ([], []))
        indices.append(index)
        copies.append(out.detach().reshape(n).clone())
        self._kept += n
        if self._kept > KEPT:
            self._reduce_small()

    def _reduce_small(self) -> None:
        if not self._small:
            return
        with torch.autocast("cpu", enabled=False):  # the step may run under the loop's autocast
            self._reduce_small_now()

    def _reduce_small_now(self) -> None:
        for indices, copies in self._small.values():
            rows = torch.stack(copies)
            self.done.append(Reduced(
                np.asarray(indices, dtype=np.int64), np.full(len(indices), float(rows.shape[1])),
                [torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)], [rows.bool().sum(1).float()],
                np.zeros(len(indices), dtype=bool), []))
        self._small, self._kept = {}, 0

    def take(self) -> list[Reduced]:
        """Hand over the statistics collected so far and start anew."""
        self._reduce_small()
        if self._one:
            one = self._one
            bounded = np.fromiter((len(values) == 3 for _, values, _ in one), dtype=bool, count=len(one))
            sat = [values[2] for _, values, _ in one if len(values) == 3]
            self.done.append(Reduced(
                np.fromiter((i for i, _, _ in one), dtype=np.int64, count=len(one)),
                np.fromiter((c for _, _, c in one), dtype=np.float64, count=len(one)),
                stacked([values[0] for _, values, _ in one]), stacked([values[1] for _, values, _ in one]),
                bounded, stacked(sat)))
        taken = self.done
        self.clear()
        return taken
