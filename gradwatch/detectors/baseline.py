"""Baseline: a robust running mean and spread (EMA), fed only the values a caller trusts."""

from __future__ import annotations

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
        mask = np.asarray(mask, dtype=bool) & np.isfinite(x)
        if not mask.any():
            return
        first = mask & (self.count == 0)
        rest = mask & ~first
        diff = np.where(rest, x - self.mean, 0.0)
        b = self.beta
        self.mean = np.where(first, x, np.where(rest, self.mean + (1 - b) * diff, self.mean))
        self.var = np.where(rest, b * (self.var + (1 - b) * diff**2), self.var)
        self.count = self.count + mask

    def std(self, floor: float = 0.0) -> np.ndarray:
        """The spread, at least ``floor``."""
        return np.maximum(np.sqrt(self.var), floor)

    def ready(self, warmup: int) -> np.ndarray:
        """Where at least ``warmup`` values have been accepted."""
        return self.count >= warmup
