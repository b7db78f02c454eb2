"""Measure: the device work of one step, and the per-layer / per-parameter vectors it yields.

:meth:`Measure.launch` only launches reductions and returns the tensors to read; the watcher
reads them (with its own extra values) in one host copy and hands the numbers back to
:meth:`Measure.vectors`, which is plain numpy.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gradwatch.step import ranges, stats
from gradwatch.step.activations import Reduced
from gradwatch.step.actvectors import activation_vectors
from gradwatch.step.aggregate import Aggregator
from gradwatch.step.layout import Discovered
from gradwatch.step.scales import Notes, Scales, put_right
from gradwatch.store.findings import Finding
from gradwatch.store.records import LAYER, PARAM

#: the activation statistics of a step's leaf calls
Activations = list[Reduced]


def _dtensor_type() -> type | None:
    """``DTensor`` if the program uses it: a model with sharded parameters imported it to make them.

    Never imported here: ``torch.distributed.tensor`` takes most of a second and tens of MiB to
    import (sympy among them), which a training process that does not shard would pay for nothing.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a sharded (FSDP2 ``DTensor``) tensor on this rank, or the tensor itself.

    The shard shares the tensor's storage, so an in-place change (clipping) changes the tensor.
    """
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t  # type: ignore[attr-defined]


def sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of these tensors is sharded across ranks (FSDP2 parameters and gradients)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


#: the vectors' keys, one tuple each for every step: a record then holds no container the garbage
#: collector tracks (its keys are untracked once seen, its values are arrays), however long it is kept
_KEYS: dict[tuple[str, str], tuple[str, str]] = {}


def _key(scope: str, metric: str) -> tuple[str, str]:
    key = (scope, metric)
    return _KEYS.setdefault(key, key)


@dataclass
class Launched:
    """What one step launched on the device, in the order it is read back."""

    sampled: bool
    gidx: list[int]  # parameters that have a gradient
    grads: list[torch.Tensor]
    tidx: list[int] = field(default_factory=list)  # trainable parameters (sampled steps)
    acts: Activations = field(default_factory=list)
    #: 1-D tensors (a few per step: one per statistic) whose values, in order, are read back
    parts: list[torch.Tensor] = field(default_factory=list)
    #: the parameters are sharded across ranks: ``parts`` are this rank's shards' statistics
    #: (see :meth:`Measure.spans` for how to combine them across ranks)
    sharded: bool = False
    #: statistics torch could not compute: ``{statistic: {position in its list: why}}`` (0 in ``parts``)
    failed: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The number of values in ``parts`` (their positions in the step's host read)."""
        return sum(p.numel() for p in self.parts)


class Measure:
    """Statistics of one layout's parameters and leaves."""

    def __init__(self, found: Discovered) -> None:
        self.found = found
        self._agg = Aggregator(found.layout)
        #: every parameter's non-finite count on a step whose gradients are all finite (shared, read-only)
        self._zeros = np.zeros(len(found.params), dtype=np.float32)
        self._zeros.flags.writeable = False
        bounded = np.zeros(len(found.layout.layers), dtype=bool)
        bounded[list(found.layout.saturating)] = True
        self._bounded = bounded
        self._every = list(range(len(found.params)))
        #: the parameters' same-shape groups (many small ones on the CPU: a few calls per statistic)
        self._groups = stats.Grouping(found.params)
        #: FSDP2: the parameters (hence their gradients) are sharded ``DTensor``s
        self.sharded = sharded(found.params)
        #: the parameters without a gradient at the latest launch (by index)
        self.missing: tuple[int, ...] = ()
        #: CPU buffers for the weights' copies of sampled steps, by parameter index
        self._pool: dict[int, torch.Tensor] = {}
        #: the parameters with a gradient at the latest snapshot (those without one are not updated)
        self._snapped: set[int] = set()
        #: the parameters whose norms are taken scaled, or known to be zero (see :mod:`gradwatch.step.ranges`)
        self.scales = Scales()
        #: what could not be measured, or was stored saturated: said once (:meth:`findings`)
        self.noted = Notes()
        #: the latest update norms' tensors and parameters, kept to re-measure one (CPU buffers only)
        self._moved: tuple[list[int], list[torch.Tensor]] | None = None

    @torch.no_grad()
    def launch(self, sampled: bool, acts: Activations) -> Launched:
        """Launch the step's reductions: gradient norms always, the costlier ones when sampled.

        An unsampled step is one fused norm over the gradients and no Python work per parameter
        beyond collecting them; the non-finite elements are counted only when a norm is not finite
        (see :meth:`vectors`).
        """
        params = self.found.params
        maybe = [p.grad for p in params]
        gidx = self._every
        grads = [g for g in maybe if g is not None]
        self.missing = ()
        if len(grads) != len(maybe):
            gidx = [i for i, g in enumerate(maybe) if g is not None]
            self.missing = tuple(i for i, g in enumerate(maybe) if g is None)
        shards = self.sharded and sharded(grads)
        if shards:  # FSDP: each rank measures its shards; the watcher combines them across ranks
            grads = [local(g) for g in grads]
        every = gidx is self._every and not shards and self._groups.useful  # grouped by shape
        gnorms = self._groups.norms(grads) if every and not self.scales.scaled["grad"] else None
        out = Launched(sampled, gidx, grads, sharded=shards)
        out.parts = [gnorms] if gnorms is not None else stats.stacked(self._norms(out, "grad", grads, gidx))
        if sampled:
            out.tidx = [i for i, p in enumerate(params) if p.requires_grad]
            out.acts = acts
            gmax = self._groups.max_abs(grads) if every else None
            if gmax is None:
                try:
                    out.parts += stats.max_abs_stacked(grads)
                except Exception:  # some gradient's type or layout: each on its own
                    out.parts += stats.stacked(stats.norms(grads, math.inf, out.failed.setdefault("grad_max", {})))
            else:
                out.parts.append(gmax)
            wnorms = self._groups.norms(params) if every and len(out.tidx) == len(params) \
                and not self.scales.scaled["param"] else None
            out.parts += [wnorms] if wnorms is not None else \
                stats.stacked(self._norms(out, "param", self._weights(out.tidx), out.tidx))
            # activation norms, then non-zero counts, then saturated counts (a few 1-D tensors each)
            out.parts += [p for r in acts for p in r.norms] + [p for r in acts for p in r.nonzeros] + \
                [p for r in acts for p in r.saturated] + [p for r in acts for p in r.counts]
        return out

    def _norms(self, out: Launched, stat: str, tensors: list[torch.Tensor], idx: list[int]) -> list[torch.Tensor]:
        """Plain and scaled norms of a statistic's tensors (:class:`Scales`); failures go to ``out.failed``."""
        return self.scales.norms(tensors, idx, stat, out.failed.setdefault(f"{stat}_norm", {}))

    def rescue(self, step: Launched, host: np.ndarray) -> None:
        """Put right in ``host`` (the step's read) the norms that did not fit their sum of squares (one more read,
        on a rare step); those torch could not compute are 0 there (out of the global norm), and noted.
        """
        weights = self._weights(step.tidx) if step.sampled else []
        put_right(self.scales, self.noted, self.found.layout, step.gidx, step.grads, step.tidx, weights,
                  host, step.sampled, step.sharded, step.failed)

    def findings(self, step: int, leaves: dict[int, str]) -> list[Finding]:
        """The ``unmeasured`` findings (info) of what was not measured or stored saturated, each once."""
        return self.noted.findings(step, self.found.layout, leaves)

    def _weights(self, idx: list[int]) -> list[torch.Tensor]:
        """The parameters at ``idx`` (this rank's shards when sharded)."""
        params = self.found.params
        if self.sharded:
            return [local(params[i]) for i in idx]
        return [params[i] for i in idx]

    @staticmethod
    def spans(step: Launched) -> list[tuple[int, int, str]]:
        """How a sharded step's statistics combine across ranks: ``(start, stop, how)`` over ``step.parts``.

        Norms combine as the root of the sum of squares (``"norm"``), largest values by maximum
        (``"max"``); activation statistics are each rank's own (its batch) and are left alone.
        """
        n = len(step.gidx)
        spans = [(0, n, "norm")]
        if step.sampled:
            spans += [(n, 2 * n, "max"), (2 * n, 2 * n + len(step.tidx), "norm")]
        return spans

    def vectors(self, step: Launched, host: np.ndarray, *, finite: bool,
                sound: bool = True) -> dict[tuple[str, str], np.ndarray]:
        """Per-parameter and per-layer vectors from the host copy of ``step.parts``.

        On the rare step with a non-finite gradient norm, the non-finite elements of the
        offending gradients are counted with one more read (a finite norm means none).
        ``finite``: the step's global gradient norm is finite (then so is every norm); ``sound``: its loss
        is finite or unknown (then, with ``finite``, an infinite activation norm is a sum of squares that overflowed).
        """
        P, n = len(self.found.params), len(step.gidx)
        gnorm = host[:n]
        bad = np.flatnonzero(~np.isfinite(gnorm)) if not finite else ()
        if n == P:  # every parameter has a gradient: the usual step
            pv = {"grad_norm": gnorm, "grad_nonfinite": self._zeros if not len(bad) else np.zeros(P)}
            has = self._agg.every
        else:
            pv = {"grad_norm": np.full(P, np.nan), "grad_nonfinite": np.full(P, np.nan)}
            pv["grad_norm"][step.gidx] = gnorm
            pv["grad_nonfinite"][step.gidx] = 0.0
            has = ~np.isnan(pv["grad_nonfinite"])
        if len(bad):
            idx = np.asarray(step.gidx)[bad]
            pv["grad_nonfinite"][idx] = stats.to_host(stats.nonfinite_counts([step.grads[i] for i in bad]))
        lost = {stat: np.asarray(step.tidx if stat == "param_norm" else step.gidx)[list(failed)]
                for stat, failed in step.failed.items() if failed}  # left out (said once: :meth:`rescue`)
        if "grad_norm" in lost:
            pv["grad_norm"] = pv["grad_norm"].copy()
            pv["grad_norm"][lost["grad_norm"]] = np.nan
        lv = {
            "grad_norm": self._agg.norm(pv["grad_norm"], has),
            "grad_nonfinite": self._agg.zeros if pv["grad_nonfinite"] is self._zeros
            else self._agg.sum(pv["grad_nonfinite"], has),
        }
        if step.sampled:
            k = n
            pv["grad_max"] = np.full(P, np.nan)
            pv["grad_max"][step.gidx] = host[k:k + n]
            k += n
            pv["param_norm"] = np.full(P, np.nan)
            pv["param_norm"][step.tidx] = host[k:k + len(step.tidx)]
            k += len(step.tidx)
            for stat in ("grad_max", "param_norm"):
                pv[stat][lost.get(stat, [])] = np.nan
            lv["grad_max"] = self._agg.max(pv["grad_max"], has)
            lv["param_norm"] = self._agg.norm(pv["param_norm"], ~np.isnan(pv["param_norm"]))
            lv.update(activation_vectors(step.acts, host[k:], finite and sound, self.found.layout, self._bounded,
                                         self.noted.pending))
        return {**{_key(LAYER, m): self._stored(LAYER, m, v) for m, v in lv.items()},
                **{_key(PARAM, m): self._stored(PARAM, m, v) for m, v in pv.items()}}

    def _stored(self, scope: str, metric: str, values: np.ndarray) -> np.ndarray:
        """A vector as the store keeps it (float32), saturated where beyond float32's range (noted per layer)."""
        out, beyond = ranges.stored(values)
        if beyond is not None and scope == LAYER:
            for i in np.flatnonzero(beyond).tolist():
                self.noted.pending.append((self.found.layout.layers[i], metric,
                                           f"beyond float32's range ({values[i]:.3g}): stored as {float(out[i]):.3g}"))
        return out

    @torch.no_grad()
    def snapshot(self, step: Launched) -> dict[int, torch.Tensor]:
        """Copies of the weights about to be updated, for the update ratio (sampled steps).

        On the CPU the copies go into buffers kept from one sampled step to the next (fresh
        allocations of that size cost more than the copy there: page faults); on an accelerator
        the caching allocator already reuses the memory, and nothing is kept between steps.
        """
        if not step.sampled or not step.gidx:
            return {}
        self._snapped = set(step.gidx)  # the parameters with a gradient on this step
        weights = self._weights(step.gidx)
        if not all(w.device.type == "cpu" for w in weights):
            return dict(zip(step.gidx, torch._foreach_mul(weights, 1.0)))
        pool = self._pool
        copies = []
        for i, w in zip(step.gidx, weights):
            buf = pool.get(i)
            if buf is None or buf.shape != w.shape or buf.dtype != w.dtype:
                buf = pool[i] = torch.empty_like(w, memory_format=torch.contiguous_format)
            copies.append(buf)
        torch._foreach_copy_(copies, weights)
        return dict(zip(step.gidx, copies))

    @torch.no_grad()
    def update_norms(
        self, before: dict[int, torch.Tensor], indices: list[int]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Launch ||w_before - w_after|| for the snapshotted parameters among ``indices``: one value
        per index, in a few 1-D tensors (one unless the parameters are on several devices).

        The parameters among ``indices`` that got no gradient on this step (frozen ones the
        optimizer was built with, an unused branch) are not snapshotted: an optimizer skips a
        parameter without a gradient, so their update is 0, known without a copy.
        """
        idx = [i for i in indices if i in before]
        still = [i for i in indices if i not in self._snapped]
        parts: list[torch.Tensor] = []
        if idx:
            moved = [before.pop(i) for i in idx]
            torch._foreach_sub_(moved, self._weights(idx))  # our own copies: in place
            scaled = any(self.scales.scaled.values())
            grouped = self._groups.norms(moved) if self._groups.useful and not self.sharded and \
                idx == self._every and not scaled else None  # in the layout's order
            parts = [grouped] if grouped is not None else stats.stacked(self.scales.norms(moved, idx, "update"))
            self._moved = (idx, moved) if all(m.device.type == "cpu" for m in moved) else None  # kept: the pool's
        if still:
            parts.append(torch.zeros(len(still), device=self._weights(still[:1])[0].device))
        return idx + still, parts

    def update_ratios(self, vectors: dict[tuple[str, str], np.ndarray], idx: list[int], host: np.ndarray) -> None:
        """Add ``update_ratio`` = ||delta w|| / ||w|| (per parameter and per layer) to a step's vectors.

        NaN only where the update was not measured (no optimizer that stepped holds the parameter):
        weights of 0 that did not move (a zero-initialised bias in a param group with learning rate
        0) have a ratio of 0, and ones that moved an infinite ratio.
        """
        delta = np.full(len(self.found.params), np.nan)
        if self._moved is not None and self._moved[0] == idx[:len(self._moved[0])]:
            self.scales.rescue(host[:len(self._moved[0])], self._moved[1], self._moved[0], "update")
        self._moved = None
        delta[idx] = host
        layer_delta = self._agg.norm(delta, ~np.isnan(delta))
        with np.errstate(invalid="ignore", divide="ignore"):
            for scope, moved in ((PARAM, delta), (LAYER, layer_delta)):
                weights = vectors[(scope, "param_norm")].astype(np.float64)
                ratio = np.where((moved == 0) & (weights == 0), 0.0, moved / weights)
                vectors[_key(scope, "update_ratio")] = ranges.stored(ratio)[0]

