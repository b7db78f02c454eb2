"""Inputs (judge stage, rare path): which of a forward call's inputs hold NaN/Inf, by name, in which rows."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.state import floats, stored, version

#: rows of an input named in its description at most
ROWS = 5
#: inputs described at most
DESCRIBED = 4
#: the names of the layouts that store only some elements
LAYOUTS = {torch.sparse_coo: "sparse COO", torch.sparse_csr: "sparse CSR", torch.sparse_csc: "sparse CSC",
           torch.sparse_bsr: "sparse BSR", torch.sparse_bsc: "sparse BSC"}


def row_mask(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A bool vector over ``t``'s dimension ``dim``: the slices that hold a NaN/Inf. A sparse tensor's
    are read off its stored values and their indices (never densified: an adjacency may be huge).
    """
    t = t.detach()
    if t.layout == torch.strided:
        bad = ~torch.isfinite(t.movedim(dim, 0).reshape(t.shape[dim], -1))
        return bad.any(dim=1) if bad.shape[1] else torch.zeros(t.shape[dim], dtype=torch.bool, device=t.device)
    coo = t if t.layout == torch.sparse_coo else t.to_sparse_coo()
    values = coo._values()
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1) if values.numel() else \
        torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    mask = torch.zeros(t.shape[dim], dtype=torch.bool, device=values.device)
    if dim < coo.sparse_dim():
        mask[coo._indices()[dim][bad]] = True
    elif bool(bad.any()):  # a dense (hybrid) dimension of the values: any stored row of it may hold them
        mask[:] = True
    return mask


def _named(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """The call's inputs by the names ``forward`` gives them (``argument 2`` where it gives none)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(kwargs.items())
    out: list[tuple[str, Any]] = []
    for name, value in bound.items():
        kind = inspect.signature(model.forward).parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif kind is inspect.Parameter.VAR_KEYWORD and isinstance(value, Mapping):
            out += list(value.items())
        else:
            out.append((name, value))
    return out


def describe(name: str, t: torch.Tensor) -> dict[str, Any] | None:
    """What one input tensor holds of NaN/Inf (None when it is finite): its name, layout, shape, the
    counts of NaN and Inf among its stored values, and the rows (first dimension) that hold them.
    """
    values = stored(t.detach())
    nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
    if not nan and not inf:
        return None
    out: dict[str, Any] = {"input": name, "layout": LAYOUTS.get(t.layout, "dense"), "shape": list(t.shape),
                           "nan": nan, "inf": inf}
    if t.dim() > 1:
        try:
            rows = torch.nonzero(row_mask(t, 0)).flatten().tolist()
        except (RuntimeError, NotImplementedError):  # a layout torch cannot turn into COO
            return out
        out.update(rows=[int(r) for r in rows[:ROWS]], rows_nonfinite=len(rows))
    return out


def held(model: nn.Module, cap: Capture) -> list[dict[str, Any]]:
    """The inputs of a captured call that hold NaN/Inf (see :func:`describe`), in argument order."""
    out = []
    for name, value in _named(model, cap.args, cap.kwargs):
        for i, t in enumerate(floats(value)):
            one = describe(name if i == 0 else f"{name}[{i}]", t)
            if one is not None:
                out.append(one)
    return out


def buffers(model: nn.Module) -> list[dict[str, Any]]:
    """The model's floating-point buffers, never written in place, that hold NaN or +Inf (see
    :func:`describe`, with ``buffer``): a graph's adjacency kept on the model. A buffer that forward
    passes update (BatchNorm's statistics, which the step's own NaN may have reached), or whose only
    non-finite values are -inf (an attention mask, meant so), is left out.
    """
    out = []
    for name, t in model.named_buffers():
        if (t.is_floating_point() or t.is_complex()) and not t.is_meta and version(t) == 0:
            values = stored(t.detach())
            if bool(torch.isnan(values).any()) or (not t.is_complex() and bool((values == float("inf")).any())):
                one = describe(name, t)
                if one is not None:
                    out.append({**one, "buffer": True})
    return out


def words(held: list[dict[str, Any]]) -> str | None:
    """``the input 'adj' (sparse COO, 40x40) holds 10 Inf, in 10 rows (30, 31, 32, 33, 34 and 5 more)``."""
    parts = []
    for one in held[:DESCRIBED]:
        shape = "x".join(str(n) for n in one["shape"]) or "scalar"
        what = " and ".join(f"{one[k]:,} {label}" for k, label in (("nan", "NaN"), ("inf", "Inf")) if one[k])
        layout = "" if one["layout"] == "dense" else f"{one['layout']}, "
        text = f"the {'buffer' if one.get('buffer') else 'input'} {one['input']!r} ({layout}{shape}) holds {what}"
        rows, n = one.get("rows") or [], int(one.get("rows_nonfinite") or 0)
        if rows:
            listed = ", ".join(str(r) for r in rows) + (f" and {n - len(rows):,} more" if n > len(rows) else "")
            text += f", in row {listed}" if n == 1 else f", in {n:,} rows ({listed})"
        parts.append(text)
    if len(held) > DESCRIBED:
        parts.append(f"{len(held) - DESCRIBED} more input{'s' if len(held) - DESCRIBED > 1 else ''}")
    return "; ".join(parts) or None
