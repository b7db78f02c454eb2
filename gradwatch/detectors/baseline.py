"""Baseline: a robust running mean and spread (EMA), fed only the values a caller trusts."""

from __future__ import annotations

import warnings

import numpy as np


class Ema:
    """Exponential moving mean and variance of one value or of a vector of values.

    Only the entries a caller passes in ``mask`` are updated, so non-finite values and flagged
    spikes never enter the baseline: one bad step cannot poison later judgement. The first
    accepted value starts the mean; the variance starts at zero.
    """

    def __init__(self, beta: float, size: int | None = None) -> None:
        shape = () if size is None else (size,)
        self.beta = beta
        self.mean = np.zeros(shape)
        self.var = np.zeros(shape)
        self.count = np.zeros(shape, dtype=np.int64)

    def update(self, x: np.ndarray | float, mask: np.ndarray | bool = True) -> None:
        """Fold ``x`` into the baseline where ``mask`` (and ``x`` is finite)."""
        x = np.asarray(x, dtype=np.float64)
        keep: np.ndarray = np.asarray(mask, dtype=bool) & np.isfinite(x)
        if not keep.any():
            return
        first = keep & (self.count == 0)
        rest = keep & ~first
        diff = np.where(rest, x - self.mean, 0.0)
        b = self.beta
        self.mean = np.where(first, x, np.where(rest, self.mean + (1 - b) * diff, self.mean))
        self.var = np.where(rest, b * (self.var + (1 - b) * diff**2), self.var)
        self.count = self.count + keep

    def std(self, floor: float = 0.0) -> np.ndarray:
        """The spread, at least ``floor``."""
        return np.maximum(np.sqrt(self.var), floor)

    def ready(self, warmup: int) -> np.ndarray:
        """Where at least ``warmup`` values have been accepted."""
        return self.count >= warmup


class Window:
    """Median and spread (1.4826 x MAD) of the last ``size`` accepted values, per column.

    Robust where an EMA is not: a few large values in the history (a noisy phase of training)
    barely move the median or the MAD. Values that a caller rejects (non-finite, flagged) leave
    a gap instead of entering. The statistics are recomputed every ``refresh`` updates, which
    keeps the per-step cost to one row write.
    """

    def __init__(self, size: int, width: int = 1, refresh: int = 10) -> None:
        self.size, self.refresh = size, refresh
        self.buf = np.full((size, width), np.nan)
        self.filled = 0
        self.center = np.full(width, np.nan)
        self.spread = np.full(width, np.nan)
        self.count = np.zeros(width, dtype=np.int64)
        self._updates = 0

    def update(self, x: np.ndarray | float, mask: np.ndarray | bool = True) -> None:
        """Append one row: ``x`` where ``mask`` and finite, a gap elsewhere."""
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        keep = np.asarray(mask, dtype=bool) & np.isfinite(x)
        self.buf[self.filled % self.size] = np.where(keep, x, np.nan)
        self.filled += 1
        self._updates += 1
        if self._updates >= self.refresh or self.filled <= self.size and self.filled % 5 == 0:
            self.recompute()

    def recompute(self) -> None:
        """Refresh the median, spread and counts from the buffer."""
        self._updates = 0
        rows = self.buf[: min(self.filled, self.size)]
        self.count = np.sum(~np.isnan(rows), axis=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-gap columns
            self.center = np.nanmedian(rows, axis=0)
            self.spread = 1.4826 * np.nanmedian(np.abs(rows - self.center), axis=0)

    def ready(self, warmup: int) -> np.ndarray:
        """Columns with at least ``warmup`` values (as of the last refresh)."""
        return self.count >= warmup
