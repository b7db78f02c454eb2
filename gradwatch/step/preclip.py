"""Pre-clip norm (measure stage): what the loop did to the gradients between backward and the step.

A loop that calls ``clip_grad_norm_`` (or ``scaler.unscale_``, or scales the gradients itself)
changes them in place after backward, so the norms measured at the step are the clipped ones and
an explosion would be hidden. At the end of every backward pass gradwatch launches the norms of
two reference gradients (the first and last trainable parameters: two tiny kernels, no sync).
At the step, when those gradients were changed in place since, the same two norms are in the
step's measurement: their ratio is the factor the loop applied. When both references agree it
was a uniform scaling (a norm clip), and the global norm before it is the measured one divided by
that factor (with a GradScaler, the scale it unscaled by is taken out first). Everything is read
with the step's one host read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradwatch.step.stats import norms
from gradwatch.store.records import CLIP_COEF, PRECLIP

#: two references agree on a uniform scaling when their factors differ by less than this (relative)
AGREE = 1e-3


@dataclass
class References:
    """Two reference gradients' norms at the end of a backward pass."""

    idx: list[int]  # parameter indices
    norms: list[torch.Tensor]  # 0-d, on the device
    versions: list[tuple[int, int]]  # (id, _version) of each gradient when its norm was taken


def reference_indices(params: Sequence[torch.Tensor]) -> list[int]:
    """The first and the last trainable parameter (one index when there is one)."""
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    return sorted({trainable[0], trainable[-1]}) if trainable else []


def take(params: Sequence[torch.Tensor], idx: list[int]) -> References | None:
    """Launch the reference norms now (the end of a backward pass); None when a reference has no gradient."""
    grads = [params[i].grad for i in idx]
    if not grads or any(g is None or g.is_sparse for g in grads):
        return None
    ready = [g for g in grads if g is not None]
    return References(idx, norms(ready), [(id(g), g._version) for g in ready])


def changed(refs: References, params: Sequence[torch.Tensor]) -> bool:
    """Whether the reference gradients were changed in place since their norms were taken."""
    now = [params[i].grad for i in refs.idx]
    if any(g is None for g in now):
        return False
    same = all(id(g) == v[0] for g, v in zip(now, refs.versions))
    return same and any(g._version != v[1] for g, v in zip(now, refs.versions) if g is not None)


def parts(refs: References, scale: torch.Tensor | None) -> list[torch.Tensor]:
    """What the step's host read takes: the reference norms, and the GradScaler's scale if any."""
    return [*refs.norms, *([scale.detach().reshape(()).float()] if scale is not None else [])]


def apply(scalars: dict[str, float], refs: References, host: np.ndarray, gnorm: np.ndarray, gidx: list[int],
          total: float, scaled: bool) -> None:
    """Record the factor the loop applied (``clip_coef``) and the global norm before it (``PRECLIP``).

    Args:
        scalars: the step's scalars, completed in place (a ``PRECLIP`` observed by the loop is kept).
        refs: the references taken at the end of backward.
        host: their norms as read (and the scale last when ``scaled``).
        gnorm: the step's per-parameter gradient norms, in ``gidx`` order.
        gidx: the parameters those norms are of.
        total: the step's global gradient norm.
        scaled: a GradScaler scaled the gradients of the backward pass.
    """
    before = np.asarray(host[:len(refs.idx)], dtype=np.float64)
    if scaled:
        scale = float(host[len(refs.idx)])
        if not (math.isfinite(scale) and scale > 0):
            return
        before = before / scale
    position = {p: k for k, p in enumerate(gidx)}
    factors = []
    for i, pre in zip(refs.idx, before):
        if i not in position or not (math.isfinite(pre) and pre > 0):
            continue
        post = float(gnorm[position[i]])
        if not math.isfinite(post):
            return
        factors.append(post / pre)
    if not factors or max(factors) - min(factors) > AGREE * max(max(factors), 1e-30):
        return  # not a uniform scaling (per-group or per-value clipping): nothing to say
    coef = float(np.mean(factors))
    if abs(coef - 1.0) <= AGREE:
        return
    scalars[CLIP_COEF] = coef
    if coef > 0 and PRECLIP not in scalars and math.isfinite(total):
        scalars[PRECLIP] = total / coef
