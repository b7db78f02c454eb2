"""Step measuring, histograms: each parameter's gradient and value histogram on sampled steps (``wandb_histograms``).

On an accelerator, computed on the parameters' device with fixed-size tensors only (no ``.item()``, no
size that depends on the data) and read with the step's one host read: no synchronisation of their own;
on the CPU, with ``torch.histc`` over each tensor's range (read at once: there is no device to wait for). Named as
``wandb.watch(model, log="all")`` names them: ``gradients/<parameter>`` and ``parameters/<parameter>``.
Non-finite elements are left out of a histogram (as ``wandb.watch`` leaves them out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

#: the bins of each histogram (``wandb.watch``'s default)
BINS = 64
#: the kinds, in the order of each parameter's parts
KINDS = ("gradients", "parameters")


def parts(params: Sequence[nn.Parameter], bins: int = BINS) -> list[Tensor]:
    """Per parameter, its gradient's and its value's ``[low, high, count per bin ...]`` (float32, on its device;
    NaN throughout for no gradient, an empty or a non-floating-point tensor).
    """
    out = []
    for p in params:
        for t in (p.grad, p):
            if t is None or t.is_sparse or not t.is_floating_point() or t.numel() == 0:
                out.append(torch.full((bins + 2,), math.nan, device=p.device))
            else:
                out.append(_histogram(t.detach(), bins))
    return out


def size(params: Sequence[nn.Parameter], bins: int = BINS) -> int:
    """How many numbers :func:`parts` of ``params`` reads."""
    return len(params) * len(KINDS) * (bins + 2)


def _histogram(t: Tensor, bins: int) -> Tensor:
    x = t.reshape(-1).float()
    # on the CPU there is no device to wait for: its range read at once, and torch.histc's one pass
    return _on_host(x, bins) if x.device.type == "cpu" else _on_device(x, bins)


def _on_device(x: Tensor, bins: int) -> Tensor:
    finite = torch.isfinite(x)
    low = torch.where(finite, x, math.inf).amin()
    high = torch.where(finite, x, -math.inf).amax()
    width = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    at = torch.nan_to_num((torch.where(finite, x, low) - low) / width * bins, nan=0.0, posinf=bins - 1, neginf=0.0)
    at = at.floor_().clamp_(0, bins - 1).long()
    counts = torch.zeros(bins, device=x.device).index_add_(0, at, finite.float())
    return torch.cat([low.reshape(1), high.reshape(1), counts])


def _on_host(x: Tensor, bins: int) -> Tensor:
    low, high = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(low) and math.isfinite(high)):
        x = x[torch.isfinite(x)]
        if not len(x):
            return torch.full((bins + 2,), math.nan)
        low, high = (float(v) for v in torch.aminmax(x))
    if high > low:
        counts = torch.histc(x, bins, low, high)
    else:
        counts = torch.zeros(bins)
        counts[0] = len(x)
    return torch.cat([torch.tensor([low, high]), counts])


def read(host: np.ndarray, names: Sequence[str], bins: int = BINS) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The histograms :func:`parts` read: ``{"gradients/<name>": (counts, bin edges)}`` ..., those with a
    finite element only.
    """
    out = {}
    rows = host.reshape(len(names), len(KINDS), bins + 2)
    for name, kinds in zip(names, rows):
        for kind, row in zip(KINDS, kinds):
            low, high, counts = float(row[0]), float(row[1]), row[2:]
            if not (math.isfinite(low) and math.isfinite(high)) or not counts.sum() > 0:
                continue
            if high <= low:  # one value throughout: a narrow first bin holds it
                high = low + max(abs(low), 1.0) * 1e-6
            out[f"{kind}/{name}"] = (counts.astype(np.int64), np.linspace(low, high, bins + 1))
    return out
