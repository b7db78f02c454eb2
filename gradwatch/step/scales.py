"""Scales (measure stage): which tensors' norms are taken scaled, and the rare re-measure of a norm that
did not fit its sum of squares (see :mod:`gradwatch.step.ranges`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradwatch.step import ranges, stats
from gradwatch.store.findings import Finding
from gradwatch.store.records import Layout

#: the statistics whose tensors :class:`Scales` follows (an update is measured scaled where any of them is)
STATS = ("grad", "param", "update")


class Scales:
    """For each statistic, the parameters whose norms are taken scaled (their plain sum of squares did not
    fit once) and those known to be exactly zero (a plain norm of 0 that needs no second look).
    """

    def __init__(self) -> None:
        self.scaled: dict[str, set[int]] = {stat: set() for stat in STATS}
        self.zero: dict[str, set[int]] = {stat: set() for stat in STATS}

    def norms(self, tensors: Sequence[torch.Tensor], idx: Sequence[int], stat: str,
              failed: dict[int, str] | None = None) -> list[torch.Tensor]:
        """The L2 norms of ``tensors`` (of the parameters ``idx``): fused plain ones, and scaled ones for
        the parameters that needed it (:func:`gradwatch.step.ranges.scaled_norms`). ``failed`` as in
        :func:`gradwatch.step.stats.norms`.
        """
        marked = self.scaled[stat] if stat != "update" else set().union(*self.scaled.values())
        if not marked:
            return stats.norms(tensors, failed=failed)
        wide = [k for k, i in enumerate(idx) if i in marked]
        if not wide:
            return stats.norms(tensors, failed=failed)
        plain = [k for k, i in enumerate(idx) if i not in marked]
        out: list[torch.Tensor | None] = [None] * len(tensors)
        lost: dict[int, str] = {}
        for k, value in zip(plain, stats.norms([tensors[k] for k in plain], failed=lost)):
            out[k] = value
        for k, value in zip(wide, ranges.scaled_norms([tensors[k] for k in wide])):
            out[k] = value
        if failed is not None:
            failed.update({plain[k]: why for k, why in lost.items()})
        return out  # type: ignore[return-value]

    def rescue(self, values: np.ndarray, tensors: Sequence[torch.Tensor], idx: Sequence[int], stat: str,
               largest: np.ndarray | None = None) -> None:
        """Re-measure, in place, the plain norms in ``values`` that may have under- or overflowed: one more
        read, on the rare step that has one; the parameters found so are measured scaled from then on.

        Args:
            values: the host's norms of ``tensors`` (a view of the step's read), in ``idx`` order.
            tensors: the tensors they are of (still as they were measured).
            idx: their parameters.
            stat: ``grad`` or ``param``.
            largest: their largest magnitudes where known (a sampled step's gradients): a norm of 0
                with a largest of 0 is a zero tensor.
        """
        with np.errstate(invalid="ignore"):
            maybe = np.flatnonzero(ranges.suspect(values) | (values > ranges.HIGH64))
        if not len(maybe):
            return
        marked, zero = self.scaled[stat], self.zero[stat]
        again = []
        for k in maybe.tolist():
            i, v, t = idx[k], values[k], tensors[k]
            if i in marked or t.numel() == 0:
                continue
            if v == 0 and (largest[k] == 0 if largest is not None else i in zero):
                zero.add(i)
                continue
            wide = t.dtype in (torch.float64, torch.complex128)
            if wide and not ranges.suspect(np.asarray([v]), True)[0]:
                continue
            again.append(k)
        if not again:
            return
        exact = torch.stack([n.to("cpu") for n in ranges.scaled_norms([tensors[k] for k in again])]).numpy()
        for k, v in zip(again, exact.tolist()):
            values[k] = v
            if v == 0:
                zero.add(idx[k])
            elif np.isfinite(v):
                marked.add(idx[k])
                zero.discard(idx[k])


#: a statistic left out, in words
_WHAT = {"grad_norm": "gradient norm", "grad_max": "largest gradient", "param_norm": "weight norm",
         "act_norm": "activation norm", "activations": "activation statistics"}


class Notes:
    """What could not be measured, or was stored saturated, per layer and statistic: said once each, as an
    ``unmeasured`` finding (severity info) of the step that found it.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[str, str, str]] = []  # (layer, statistic, why)
        self.said: set[tuple[str, str]] = set()  # (layer, statistic:cause)

    def param(self, layout: Layout, i: int, stat: str, why: str) -> None:
        """Note a parameter's statistic (for each layer that owns it)."""
        self.pending += [(layout.layers[layer], stat, why) for layer, param in layout.owners if param == i]

    def findings(self, step: int, layout: Layout, leaves: dict[int, str]) -> list[Finding]:
        """The findings of what was noted since the last call, and of the leaves whose activation statistics
        torch could not compute (``leaves``: layer index -> why), each (layer, statistic) once per run.
        """
        notes, self.pending = self.pending, []
        notes += [(layout.layers[i], "activations", why) for i, why in leaves.items() if i < len(layout.layers)]
        out = []
        for layer, stat, why in notes:
            key = (layer, f"{stat}:{why.split(' ', 1)[0]}")  # once per layer, statistic and kind of cause
            if key in self.said:
                continue
            self.said.add(key)
            what = _WHAT.get(stat, stat)
            if why.startswith(("beyond", "its float32")):
                message = f"`{layer}`'s {what} at step {step}: {why}."
            else:
                message = (f"gradwatch cannot compute `{layer}`'s {what} ({why}): it is left out for this layer "
                           "from now on; everything else is watched.")
            out.append(Finding(kind="unmeasured", severity="info", step=step, layer=layer, message=message,
                               data={"metric": stat, "why": why}))
        return out


def put_right(scales: Scales, noted: Notes, layout: Layout, gidx: list[int], grads: list[torch.Tensor],
              tidx: list[int], weights: list[torch.Tensor], host: np.ndarray, sampled: bool, sharded: bool,
              failed: dict[str, dict[int, str]]) -> None:
    """Put right, in a step's read (``host``, in place), the gradient and weight norms that did not fit their
    sum of squares (:meth:`Scales.rescue`), and bring every value within float32's range (saturated, and
    noted); note the statistics torch could not compute (``failed``: 0 in ``host``, out of the global norm).

    ``host`` holds the gradients' norms (``gidx`` order), then on a sampled step their largest magnitudes
    and the weights' norms (``tidx`` order).
    """
    n = len(gidx)
    if not sharded:  # (a shard's norm is a part of a norm)
        scales.rescue(host[:n], grads, gidx, "grad", host[n:2 * n] if sampled else None)
        if sampled:
            scales.rescue(host[2 * n:2 * n + len(tidx)], weights, tidx, "param")
    spans = [("grad_norm", 0, gidx)] + ([("grad_max", n, gidx), ("param_norm", 2 * n, tidx)] if sampled else [])
    for stat, at, params in spans:  # within float32's range (the store's): saturated, and said
        host[at:at + len(params)], beyond = ranges.clamp(host[at:at + len(params)])
        for k in np.flatnonzero(beyond).tolist() if beyond is not None else []:
            noted.param(layout, params[k], stat, "beyond float32's range: stored saturated")
    for stat, lost in failed.items():
        for k, why in lost.items():
            noted.param(layout, (tidx if stat == "param_norm" else gidx)[k], stat, why)
