"""Ranges (measure stage): statistics at every scale their dtype holds, and stored within float32's.

A norm is a float32 sum of squares on the device (float64 for float64 and complex128 tensors): one
fused pass, which under- or overflows while the norm itself fits (elements below ~1e-19 square to
float32's subnormals, and below ~1e-23 to 0; above ~1.8e19 to inf). The rare values whose plain
sum may have done so (:func:`suspect`) are recomputed with :func:`scaled_norms`, which holds every
scale, and the tensors that needed it are measured that way from then on (no further read). The
run store keeps float32 vectors: a value beyond float32's range is stored at its end, saturated
(:func:`stored`), and said once.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

#: the range of the run store's float32 vectors: a statistic beyond it is stored saturated at its end
F32_MAX = float(torch.finfo(torch.float32).max)
F32_TINY = float(torch.finfo(torch.float32).smallest_normal)
#: float32's smallest value above 0 (subnormal): a non-zero norm below it is stored as it
F32_LEAST = float(np.nextafter(np.float32(0), np.float32(1)))
#: the types whose statistics are reduced in float32 (float16 and bfloat16 widened): wider ones keep float64
NARROW = (torch.float32, torch.float16, torch.bfloat16)
#: a float32 sum of squares is exact enough from this norm on (smaller: its squares may be subnormal or 0)
LOW = 1e-15
#: a float64 sum of squares is exact enough between these norms
LOW64, HIGH64 = 1e-140, 1e140
_INF = float("inf")


def dense(t: Tensor) -> Tensor:
    """A sparse tensor's stored values (its norms and largest value are theirs), or the tensor."""
    return t.coalesce().values() if t.is_sparse else t


def real(t: Tensor) -> Tensor:
    """A real statistic as float32, or as float64 when it is one (a float64 tensor's may not fit float32)."""
    return t if t.dtype == torch.float64 else t.float()


def scaled_norms(tensors: list[Tensor]) -> list[Tensor]:
    """L2 norms that neither overflow nor underflow wherever the norm itself is a float64 (0-d float64
    tensors, on the device, no read): a float32, float16 or bfloat16 tensor's is summed in float64 (whose
    squares hold any of their values); a float64 or complex tensor's is ``m * ||x / m||`` with ``m``
    its largest magnitude. A few passes each: for the tensors whose plain norm did not fit.
    """
    out = []
    for t in tensors:
        t = dense(t.detach())
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.dtype in NARROW:
            out.append(torch.linalg.vector_norm(t.double()))
            continue
        t = t.to(torch.complex128) if t.is_complex() else t.double()
        m = torch.linalg.vector_norm(t, _INF) if t.numel() else torch.zeros((), dtype=torch.float64, device=t.device)
        safe = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m))
        out.append(torch.linalg.vector_norm(t / safe) * safe)
    return out


def suspect(values: np.ndarray, wide: np.ndarray | bool = False) -> np.ndarray:
    """Which plain norms may have under- or overflowed (0 included: a zero tensor's norm is 0 too, the
    caller knows which are): below :data:`LOW` or infinite, and for a float64 (``wide``) tensor below
    :data:`LOW64` or above :data:`HIGH64`. NaN is never suspect (a NaN element).
    """
    with np.errstate(invalid="ignore"):
        narrow = (values < LOW) | np.isinf(values)
        if wide is False:
            return narrow
        return np.where(wide, (values < LOW64) | (values > HIGH64), narrow)


def clamp(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Host values (float64) within float32's range, as :func:`stored` keeps them, and where they were not
    (None: all were, the usual case): before a sum of their squares, which float64 then holds.
    """
    with np.errstate(invalid="ignore"):
        a = np.abs(values)
        beyond = np.isfinite(a) & (a > F32_MAX) | (a < F32_LEAST) & (a > 0)
    if not beyond.any():
        return values, None
    out = values.copy()
    out[beyond] = np.sign(values[beyond]) * np.where(a[beyond] > 1, F32_MAX, F32_LEAST)
    return out, beyond


def stored(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``values`` as the store keeps them, float32, saturated at its range's ends (a finite value beyond
    float32's largest is that largest, a non-zero one below its smallest (subnormal) value that value), and
    where they were saturated (None when none was: the usual case, two vector comparisons).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        out = values.astype(np.float32, copy=False)
        over = np.isinf(out) & np.isfinite(values)
        under = (out == 0) & (values != 0)
    if not (over.any() or under.any()):
        return out, None
    out = out.copy() if out is values else out  # a float32 vector of the caller's
    out[over] = np.sign(values[over]) * F32_MAX
    out[under] = np.sign(values[under]) * F32_LEAST
    return out, over | under
