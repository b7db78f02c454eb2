"""Samples (judge stage, rare path): which samples of the batch to blame, and what their values look like."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.facts import g
from gradwatch.rootcause.inputs import row_mask
from gradwatch.rootcause.state import floats, tensors

#: a blamed set of samples is "concentrated" when it is at most this fraction of the batch (or one sample)
FEW = 0.1
#: ...and carries at least this share of the total
SHARE = 0.5
#: a sample whose largest |value| is this many times the batch's typical one is an outlier
OUTLIER = 100.0
#: blamed samples described one by one at most
DESCRIBED = 8


def batch_dim(t: torch.Tensor, batch: int) -> int | None:
    """The dimension of ``t`` that runs over the batch's samples (0, else 1 for sequence-first), or None."""
    if t.dim() > 0 and t.shape[0] == batch:
        return 0
    if t.dim() > 1 and t.shape[1] == batch:
        return 1
    return None


def per_sample(t: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``t`` as ``[batch, -1]`` (a view where possible), or None when it has no batch dimension (or is
    sparse: its rows are never densified, see :func:`nonfinite_rows`).
    """
    dim = batch_dim(t, batch)
    return None if dim is None or t.layout != torch.strided else t.detach().movedim(dim, 0).reshape(batch, -1)


def nonfinite_rows(obj: Any, batch: int | None) -> list[int] | None:
    """The samples whose rows of the tensors in ``obj`` hold NaN/Inf (None: no tensor has a batch dimension)."""
    if batch is None:
        return None
    bad: torch.Tensor | None = None
    for t in floats(obj):
        dim = batch_dim(t, batch)
        if dim is not None:
            here = row_mask(t, dim)
            bad = here if bad is None else bad | here.to(bad.device)
    return None if bad is None else [int(i) for i in torch.nonzero(bad).flatten().tolist()]


def concentrated(scores: torch.Tensor) -> list[int] | None:
    """The fewest samples carrying at least :data:`SHARE` of ``scores`` (non-negative, one per sample),
    provided they are few (at most :data:`FEW` of the batch, or one); None when it is spread.
    """
    s = scores.detach().double().cpu().clamp(min=0)
    total = float(s.sum())
    if not math.isfinite(total) or total <= 0:
        bad = torch.nonzero(~torch.isfinite(s)).flatten().tolist()
        return [int(i) for i in bad] or None
    order = torch.argsort(s, descending=True)
    cum = torch.cumsum(s[order], 0) / total
    k = int(torch.searchsorted(cum, torch.tensor([SHARE], dtype=cum.dtype))[0]) + 1
    if k > max(1, math.floor(FEW * len(s))):
        return None
    return sorted(int(i) for i in order[:k])


def _input(cap: Capture, numbers: bool = False) -> torch.Tensor | None:
    """The batch's first floating-point input with a batch dimension, as ``[batch, -1]`` (with
    ``numbers``, else its first integer one: token ids, class indices).
    """
    batch = cap.batch
    if batch is None:
        return None
    found = [t for t in floats((cap.args, cap.kwargs))]
    if numbers:
        found += [t for t in tensors((cap.args, cap.kwargs)) if not (t.is_floating_point() or t.is_complex())
                  and t.dtype != torch.bool]
    for t in found:
        rows = per_sample(t, batch)
        if rows is not None:
            return rows
    return None


def outliers(cap: Capture, indices: list[int]) -> str | None:
    """How the blamed samples' inputs stand out, when each is an outlier of the batch (else None)."""
    rows = _input(cap)
    if rows is None or not indices or len(indices) >= rows.shape[0]:
        return None
    with torch.no_grad():
        top = rows.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax(dim=1)
        others = torch.ones(rows.shape[0], dtype=torch.bool)
        others[indices] = False
        typical = float(top[others.to(top.device)].median())
        worst = min(float(top[i]) for i in indices)
    if typical <= 0 or worst < OUTLIER * typical:
        return None
    return f"their inputs reach {g(worst)}, {g(worst / typical)}x the batch's typical largest value ({g(typical)})"


def describe(cap: Capture, indices: list[int], offset: int = 0) -> list[str]:
    """A summary of each blamed sample's input values (first :data:`DESCRIBED`), each named by its
    index plus ``offset`` (micro-batches counted in order).
    """
    rows = _input(cap, numbers=True)
    if rows is None:
        return []
    out = []
    with torch.no_grad():
        for i in indices[:DESCRIBED]:
            if not 0 <= i < rows.shape[0]:
                continue
            r = rows[i].double()
            nan, inf = int(torch.isnan(r).sum()), int(torch.isinf(r).sum())
            fin = r[torch.isfinite(r)]
            text = f"sample {offset + i}"
            ids = cap.sample_ids([i])
            if ids is not None:
                text += f" (id {ids[0]!r})"
            text += f": {r.numel():,} values"
            if nan or inf:
                text += f", {nan:,} NaN, {inf:,} Inf"
            if fin.numel():
                text += f", range [{g(float(fin.min()))}, {g(float(fin.max()))}], mean {g(float(fin.mean()))}"
            out.append(text)
    return out


def blamed(cap: Capture, indices: list[int], how: str, *, offset: int = 0, **extra: Any) -> dict[str, Any]:
    """The ``samples`` record of a finding: indices in the batch, the user's ids, how they were found,
    and a summary of their values. ``offset`` shifts indices when micro-batches are counted in order.
    """
    out: dict[str, Any] = {"indices": [offset + i for i in indices], "ids": cap.sample_ids(indices),
                           "batch": cap.batch, "how": how, "values": describe(cap, indices, offset)}
    out.update(extra)
    return out

