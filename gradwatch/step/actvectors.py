"""Activation vectors (measure stage): a sampled step's leaf calls' statistics, as read, into per-layer vectors.

A layer's ``act_norm`` is the root of the sum of its calls' squared norms (its outputs' elements
together), its ``act_zero_frac`` and ``act_sat_frac`` the fractions of the elements its counts
looked at. A call whose plain norm did not fit its sum of squares is left out of its step, and its
leaf measured scaled from then on (:mod:`gradwatch.step.ranges`).
"""

from __future__ import annotations

import numpy as np

from gradwatch.step import ranges
from gradwatch.step.activations import EXACT, WIDE, Reduced
from gradwatch.store.records import Layout


def activation_vectors(acts: list[Reduced], host: np.ndarray, finite: bool, layout: Layout, bounded_layers: np.ndarray,
                       notes: list[tuple[str, str, str]]) -> dict[str, np.ndarray]:
    """The per-layer activation vectors (``act_norm``, ``act_zero_frac``, ``act_sat_frac``) of a sampled
    step's leaf calls, from the host's read of their statistics.

    Args:
        acts: the calls' statistics, as launched.
        host: their values as read (norms, non-zeros, saturated counts, device-summed counts).
        finite: the step's gradients are finite (an infinite norm is then a sum of squares that overflowed).
        layout: the layers.
        bounded_layers: which layers have a saturated count (bounded activations).
        notes: where the calls left out are noted (``(layer, metric, why)``).
    """
    L = len(layout.layers)
    if acts:
        index = np.concatenate([r.index for r in acts])
        bounded = np.concatenate([r.bounded for r in acts])
        count = np.concatenate([r.counted for r in acts])
    else:
        index, bounded, count = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), np.zeros(0)
    n, b = len(index), int(bounded.sum())
    # host: every call's norm, then every call's number of non-zeros, then the saturated counts, then
    # the counted elements of the calls summed on the device (NaN in ``counted``)
    device = np.isnan(count)
    if device.any():
        count[device] = host[2 * n + b:2 * n + b + int(device.sum())]
    norm, weight = host[:n], None
    misfit = _misfits(acts, norm, host[n:2 * n], finite, layout, notes)
    if misfit is not None:  # left out of this step, measured scaled from the next sampled step on
        weight = (~misfit).astype(np.float64)
        norm, count = np.where(misfit, 0.0, norm), np.where(misfit, 0.0, count)
    norm, beyond = ranges.clamp(norm)  # within float32's range (the store's), whose squares float64 holds
    for i in sorted(set(index[beyond].tolist())) if beyond is not None else []:
        notes.append((layout.layers[i], "act_norm", "beyond float32's range: stored saturated"))
    sumsq = np.bincount(index, weights=norm ** 2, minlength=L)
    numel = np.bincount(index, weights=count, minlength=L)
    nonzero = host[n:2 * n] if weight is None else host[n:2 * n] * weight
    zeros = numel - np.bincount(index, weights=nonzero, minlength=L)  # the device counted non-zeros
    sat = np.bincount(index[bounded], weights=host[2 * n:2 * n + b] * (1 if weight is None else weight[bounded]),
                      minlength=L)
    seen = numel > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        sat_frac = np.where(seen & bounded_layers, sat / numel, np.nan)
        return {
            "act_norm": np.where(seen, np.sqrt(sumsq), np.nan),
            "act_zero_frac": np.where(seen, zeros / numel, np.nan),
            "act_sat_frac": sat_frac,
        }

def _misfits(acts: list[Reduced], norm: np.ndarray, nonzero: np.ndarray, finite: bool, layout: Layout,
             notes: list[tuple[str, str, str]]) -> np.ndarray | None:
    """The calls whose plain norm may not have fitted its sum of squares (None: none, the usual case): 0
    or tiny with non-zero elements, or infinite on a step whose gradients are finite. Their leaves are
    measured scaled from now on (their tensors are gone: this step leaves them out, and says so).
    """
    with np.errstate(invalid="ignore"):
        tiny = (norm < ranges.LOW) & (nonzero > 0)
        inf = np.isinf(norm) & finite  # an infinite norm on a step whose gradients and loss are finite
        maybe = tiny | inf | (norm > ranges.HIGH64) & ~np.isinf(norm)
    if not maybe.any():
        return None
    how = np.concatenate([r.how if r.how is not None else np.zeros(len(r.index), dtype=np.int8) for r in acts])
    wide = how == WIDE
    with np.errstate(invalid="ignore"):
        maybe &= (how != EXACT) & np.where(wide, (norm < ranges.LOW64) & (nonzero > 0) | (norm > ranges.HIGH64)
                                           & ~np.isinf(norm) | inf, True)
    if not maybe.any():
        return None
    index = np.concatenate([r.index for r in acts])
    layers = layout.layers
    for r in acts:
        if r.scaled is not None:
            r.scaled.update(index[maybe].tolist())
    for i in sorted(set(index[maybe].tolist())):
        notes.append((layers[i], "act_norm", "its float32 sum of squares over- or underflowed: left out on "
                           "this step, measured scaled from the next sampled step on"))
    return maybe

