"""Stats: turns tensors into numbers — device-side reductions, then one read to the host per step.

Every function here only launches device work and returns tensors, except :func:`to_host`,
which is the single place where values cross to the host. Nothing downstream sees a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradwatch.step.ranges import NARROW, real, scaled_norms
from gradwatch.step.ranges import dense as _dense

_INF = float("inf")


def _foreach_norm(tensors: list[Tensor], ord: float) -> list[Tensor]:
    """Norms of tensors of one device and dtype: float32, or float64 for float64 and complex128 tensors
    (never narrowed: their norms may be beyond float32's range). A complex tensor's is of its magnitudes.
    """
    if tensors[0].dtype in NARROW:
        try:
            return list(torch._foreach_norm(tensors, ord, dtype=torch.float32))
        except TypeError:  # torch < 2.4 has no dtype argument
            pass
    return [real(n) for n in torch._foreach_norm(tensors, ord)]


def norm_of(t: Tensor, ord: float = 2.0) -> Tensor:
    """One tensor's norm by the plainest route (densified, any layout torch can read): what is left to
    try when a fused call refuses a tensor.
    """
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return real(torch.linalg.vector_norm(t, ord))


def norms(tensors: Sequence[Tensor], ord: float = 2.0, failed: dict[int, str] | None = None) -> list[Tensor]:
    """Vector norms of many tensors as 0-d tensors (float32, float64 for float64 and complex128 ones),
    one fused call per device and dtype.

    With ``failed``, a tensor whose norm cannot be computed (a dtype or layout torch does not reduce
    there) gets a 0 and its position and the reason in ``failed``; without, the error is raised.
    """
    if not tensors:
        return []
    try:  # the usual case (one device, one floating type, dense): one fused call, no Python per tensor
        return list(torch._foreach_norm(tensors if isinstance(tensors, list) else list(tensors), ord,
                                        dtype=torch.float32))
    except (RuntimeError, TypeError):  # several devices or dtypes, wide, complex, sparse: grouped below
        pass
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype, t.is_sparse), []).append(i)
    for idx in groups.values():
        try:
            result = _foreach_norm([_dense(tensors[i]) for i in idx], ord)
        except Exception:  # one of them cannot be reduced so: each on its own
            result = [_one(tensors[i], i, ord, failed) for i in idx]
        for i, r in zip(idx, result):
            out[i] = r
    return out  # type: ignore[return-value]


def _one(t: Tensor, i: int, ord: float, failed: dict[int, str] | None) -> Tensor:
    try:
        return norm_of(t, ord)
    except Exception as exc:
        if failed is None:
            raise
        failed[i] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        return torch.zeros((), device=t.device)


#: on the CPU, a tensor of at most this many elements is reduced together with the others of its
#: shape and type: stacked, then one reduction over the rows. A fused per-tensor call dispatches a
#: kernel per tensor there (a few microseconds each: 5-10 ms for the 4,004 gradients of a stack of
#: a thousand tiny blocks, against 1 ms stacked); a larger tensor is not worth its copy
SMALL = 1024
#: fewer tensors of one shape than this are reduced with the rest
GROUP = 8
#: fewer grouped tensors in all than this: the fused calls (a stack and an index per statistic cost
#: more than the few dispatches they would save)
GROUPED = 128


class Grouping:
    """The same-shape groups of a fixed list of tensors (a layout's parameters, or their gradients,
    which have the parameters' shapes, types and devices): their norms and largest values in a few
    calls on the CPU, in the list's order.

    Built once per layout; ``useful`` is False where nothing groups (a GPU, large tensors), and the
    fused per-tensor calls are taken instead.
    """

    def __init__(self, like: Sequence[Tensor]) -> None:
        groups: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
        for i, t in enumerate(like):
            if t.device.type == "cpu" and t.layout == torch.strided and 0 < t.numel() <= SMALL \
                    and t.dtype in (torch.float32, torch.float16, torch.bfloat16):
                groups.setdefault((tuple(t.shape), t.dtype), []).append(i)
        self.groups = [idx for idx in groups.values() if len(idx) >= GROUP]
        grouped = {i for idx in self.groups for i in idx}
        self.rest = [i for i in range(len(like)) if i not in grouped]
        # (a model split across devices keeps the fused calls: the groups' norms and the others' would not join)
        self.useful = len(grouped) >= GROUPED and all(like[i].device.type == "cpu" for i in self.rest)
        order = [i for idx in self.groups for i in idx] + self.rest
        self._inverse = torch.empty(len(order), dtype=torch.long)
        self._inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))

    def _rows(self, tensors: Sequence[Tensor], idx: list[int]) -> Tensor:
        rows = torch.stack([tensors[i] for i in idx])
        if rows.layout != torch.strided:  # a sparse gradient where the parameter is dense: not grouped
            raise RuntimeError("a sparse tensor in a group")
        return rows.view(len(idx), -1)

    def norms(self, tensors: Sequence[Tensor], ord: float = 2.0) -> Tensor | None:
        """The norms of ``tensors`` (one per tensor of the layout, in order) as a 1-D float32 tensor;
        None when they do not group as the layout's did (the caller takes the fused calls).
        """
        try:
            parts = [torch.linalg.vector_norm(self._rows(tensors, idx), ord, dim=1, dtype=torch.float32)
                     for idx in self.groups]
            if self.rest:
                parts += stacked(norms([tensors[i] for i in self.rest], ord))
            return torch.cat(parts)[self._inverse]
        except RuntimeError:
            return None

    def max_abs(self, tensors: Sequence[Tensor]) -> Tensor | None:
        """The largest absolute value of each tensor as a 1-D float32 tensor (NaN where one holds a NaN);
        None when they do not group as the layout's did.
        """
        try:
            parts = [self._rows(tensors, idx).abs().amax(1).float() for idx in self.groups]
            if self.rest:
                parts += max_abs_stacked([tensors[i] for i in self.rest])
            return torch.cat(parts)[self._inverse]
        except RuntimeError:
            return None


def max_abs(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Largest absolute value of each tensor (0-d float32 tensors)."""
    if not tensors:
        return []
    if any(t.numel() == 0 for t in tensors):  # an empty shard (FSDP) has no largest value: 0
        full = [i for i, t in enumerate(tensors) if t.numel()]
        found = dict(zip(full, max_abs([tensors[i] for i in full])))
        return [found[i] if i in found else t.new_zeros((), dtype=torch.float32) for i, t in enumerate(tensors)]
    device = tensors[0].device
    if device.type == "cpu" and all(t.device == device and not t.is_sparse and not t.is_complex() for t in tensors):
        # on CPU one min/max pass per tensor, then one vector op, beats the inf-norm kernel
        ends = [torch.aminmax(t) for t in tensors]
        lo = real(torch.stack([e[0] for e in ends])).abs()
        hi = real(torch.stack([e[1] for e in ends])).abs()
        return list(torch.maximum(lo, hi).unbind())
    return norms(tensors, _INF)


def stacked(values: list[Tensor]) -> list[Tensor]:
    """0-d tensors as 1-D float32 tensors to read back: one, or one per value when they are on
    several devices (the host read groups them per device).
    """
    if not values:
        return []
    try:
        return [real(torch.stack(values))]
    except RuntimeError:  # several devices: a model split across devices
        return [real(v.reshape(1)) for v in values]


def max_abs_stacked(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Largest absolute value of each tensor as 1-D float32 tensors: one, unless the tensors are
    on several devices (then one per tensor: the host read groups them per device).

    On the CPU, one min/max pass per tensor and one stack of the ends (no 0-d tensor per value
    to stack again); elsewhere the fused inf-norm.
    """
    if tensors and all(t.device.type == "cpu" and not t.is_sparse and t.numel() and t.dtype in NARROW
                       for t in tensors):
        try:
            ends = torch.stack([e for t in tensors for e in torch.aminmax(t)])
        except RuntimeError:  # several dtypes
            pass
        else:
            return [ends.float().abs().view(-1, 2).amax(1)]
    return stacked(max_abs(tensors))


def nonfinite_counts(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Number of NaN/Inf elements of each tensor (0-d tensors)."""
    return [(~torch.isfinite(_dense(t))).sum() for t in tensors]


def nonzeros(t: Tensor) -> Tensor:
    """Number of non-zero elements of a tensor (NaN and Inf count), as a 0-d integer tensor.

    On the CPU ``count_nonzero`` is a scalar loop, several times slower than converting to bool
    and summing in int32 (exact below 2**31 elements): that is used there.
    """
    if t.device.type == "cpu":
        return t.bool().sum(dtype=torch.int32 if t.numel() < 2**31 else torch.int64)
    return torch.count_nonzero(t)


#: the zero and saturated counts of an activation look at this many of its elements at most: all of
#: a smaller one, 16 evenly spread runs of 4,096 of a larger contiguous one (the norm is over every
#: element). A fraction of dead or saturated units is as well known from 65,536 elements as from
#: millions, and counting them all read a large activation twice more (most of a sampled step's
#: cost on a transformer).
COUNTED = 1 << 16
_RUNS = 16


def counted(t: Tensor) -> Tensor:
    """The elements of an activation that its zero and saturated counts look at (a view, no copy)."""
    n = t.numel()
    if n <= COUNTED or not t.is_contiguous():
        return t
    stride = n // _RUNS
    return t.reshape(-1)[: stride * _RUNS].view(_RUNS, stride)[:, : COUNTED // _RUNS]


def vector_norm(t: Tensor, dim: int | None = None) -> Tensor:
    """``torch.linalg.vector_norm`` in float32, or float64 for a float64 or complex128 tensor (a complex
    tensor's is of its magnitudes).
    """
    if t.dtype in NARROW:
        return torch.linalg.vector_norm(t, dim=dim, dtype=torch.float32)
    return real(torch.linalg.vector_norm(t, dim=dim))


def activation_stats(out: Tensor, bounds: tuple[float, float] | None,
                     scaled: bool = False) -> tuple[list[Tensor], int]:
    """Device reductions of one activation: [L2 norm, number of non-zeros(, number saturated)], and
    the number of elements the counts are of (see :data:`COUNTED`).

    An output counts as saturated when it lies within 1% of the output range from either
    bound, e.g. sigmoid below 0.01 or above 0.99, tanh beyond +-0.98 (never a complex one). With
    ``scaled``, the norm is :func:`scaled_norms`'s (an output whose float32 sum of squares did not fit).
    """
    out = out.detach()
    if out.is_complex():
        bounds = None
    part = counted(out)
    stats = [scaled_norms([out])[0] if scaled else vector_norm(out), nonzeros(part)]
    if bounds is not None:
        stats.append(saturated(part, bounds))
    return stats, part.numel()


def _near_bounds(t: Tensor, bounds: tuple[float, float]) -> Tensor:
    """Whether each element of ``t`` lies within 1% of the output range from either bound."""
    lo, hi = bounds
    mid, half = (lo + hi) / 2.0, (hi - lo) / 2.0
    return (t - mid).abs() >= 0.98 * half


def saturated(t: Tensor, bounds: tuple[float, float]) -> Tensor:
    """Number of elements of ``t`` within 1% of the output range from either bound (0-d tensor)."""
    return _near_bounds(t, bounds).sum(dtype=torch.int32 if t.numel() < 2**31 else torch.int64)


def saturated_rows(rows: Tensor, bounds: tuple[float, float]) -> Tensor:
    """:func:`saturated` of each row of a 2-D tensor (1-D tensor, one count per row)."""
    return _near_bounds(rows, bounds).sum(1, dtype=torch.int32)  # rows of far fewer than 2**31


def to_host(values: Sequence[Tensor]) -> np.ndarray:
    """Copy tensors (0-d or 1-D, in order) to the host as one float64 array: one synchronisation per device.

    Values are read as float32, except where a tensor is float64 (a float64 model's statistics).
    """
    if not values:
        return np.zeros(0)
    flat = [v.reshape(-1) for v in values]
    try:  # the usual case (one device): one concatenation, one copy
        joined = torch.cat(flat)
    except RuntimeError:  # tensors on several devices: one concatenation and copy per device
        return _to_host_by_device(flat)
    if joined.dtype not in (torch.float32, torch.float64):  # a float64 statistic is read as it is
        joined = joined.to(torch.float32)
    return joined.cpu().numpy().astype(np.float64)


def _to_host_by_device(flat: list[Tensor]) -> np.ndarray:
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(flat):
        by_device.setdefault(v.device, []).append(i)
    sizes = [v.numel() for v in flat]
    starts = np.concatenate(([0], np.cumsum(sizes)))
    result = np.empty(int(starts[-1]), dtype=np.float64)
    for idx in by_device.values():
        values = torch.cat([flat[i] if flat[i].dtype == torch.float64 else flat[i].to(torch.float32)
                            for i in idx]).cpu().numpy()
        at = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in idx])
        result[at] = values
    return result
