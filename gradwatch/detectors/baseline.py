"""Baselines fed only the values a caller trusts: an EMA of one value, a robust window per column."""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class Ema:
    """Exponential moving mean and variance of one value.

    Only values a caller accepts are folded in, so non-finite values and flagged spikes never
    enter the baseline: one bad step cannot poison later judgement. The first accepted value
    starts the mean; the variance starts at zero. Plain floats: this runs on every step.
    """

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def update(self, x: float, accept: bool = True) -> None:
        """Fold ``x`` into the baseline if ``accept`` and ``x`` is finite."""
        if not accept or not math.isfinite(x):
            return
        if self.count == 0:
            self.mean = x
        else:
            b, diff = self.beta, x - self.mean
            self.mean += (1 - b) * diff
            self.var = b * (self.var + (1 - b) * diff * diff)
        self.count += 1

    def std(self, floor: float = 0.0) -> float:
        """The spread, at least ``floor``."""
        return max(math.sqrt(self.var), floor)

    def ready(self, warmup: int) -> bool:
        """Whether at least ``warmup`` values have been accepted."""
        return self.count >= warmup


class Window:
    """Median and spread (1.4826 x MAD) of the last ``size`` accepted values, per column.

    Robust where an EMA is not: a few large values in the history (a noisy phase of training)
    barely move the median or the MAD. Values that a caller rejects (non-finite, flagged) leave
    a gap instead of entering. The statistics are recomputed every ``refresh`` updates (and on
    each of the first few, so that a young window can judge early), which keeps the per-step
    cost to one row write.
    """

    def __init__(self, size: int, width: int = 1, refresh: int = 10) -> None:
        self.size, self.refresh = size, refresh
        self.buf = np.full((size, width), np.nan)
        self.filled = 0
        self.center = np.full(width, np.nan)
        self.spread = np.full(width, np.nan)
        self.count = np.zeros(width, dtype=np.int64)
        self._updates = 0
        self.version = 0  # counts recomputes: statistics derived from this window can be cached

    def update(self, x: np.ndarray | float, mask: np.ndarray | bool = True) -> None:
        """Append one row: ``x`` where ``mask`` and finite, a gap elsewhere."""
        if isinstance(x, float):  # one number (a global value): plain Python, no arrays to build
            self.buf[self.filled % self.size] = x if mask and math.isfinite(x) else math.nan
        else:
            x = np.asarray(x, dtype=np.float64).reshape(-1)
            keep = np.asarray(mask, dtype=bool) & np.isfinite(x)
            self.buf[self.filled % self.size] = np.where(keep, x, np.nan)
        self._appended()

    def put(self, x: np.ndarray) -> None:
        """Append one row as it is: finite values, NaN for gaps (the usual step: no masking)."""
        self.buf[self.filled % self.size] = x
        self._appended()

    def _appended(self) -> None:
        self.filled += 1
        self._updates += 1
        if self._updates >= self.refresh or self.filled <= self.size and (self.filled < 5 or self.filled % 5 == 0):
            self.recompute()

    def recompute(self) -> None:
        """Refresh the median, spread and counts from the buffer."""
        self._updates = 0
        self.version += 1
        rows = self.buf[: min(self.filled, self.size)]
        self.count = np.sum(~np.isnan(rows), axis=0)
        self.center = _nanmedian(rows, self.count)
        self.spread = 1.4826 * _nanmedian(np.abs(rows - self.center), self.count)

    def ready(self, warmup: int) -> np.ndarray:
        """Columns with at least ``warmup`` values (as of the last refresh)."""
        return self.count >= warmup

    def peak(self, cols: np.ndarray) -> np.ndarray:
        """The largest value in the window of each column of ``cols`` (NaN for an empty one); for the
        rare flagged value only (it scans the buffer).
        """
        rows = self.buf[: min(self.filled, self.size)][:, cols]
        if rows.shape[0] == 0:
            return np.full(len(cols), np.nan)
        with np.errstate(invalid="ignore"):
            return np.fmax.reduce(rows, axis=0)


def _nanmedian(rows: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of each column ignoring NaN (NaN for an all-NaN column), given the non-NaN counts.

    One sort of the whole block (NaN sorts last): far cheaper than ``np.nanmedian``, which
    loops over the columns in Python for small arrays.
    """
    if rows.shape[0] == 0:
        return np.full(rows.shape[1], np.nan)
    ordered = np.sort(rows, axis=0)
    cols = np.arange(rows.shape[1])
    last = np.maximum(count - 1, 0)
    median = 0.5 * (ordered[last // 2, cols] + ordered[(last + 1) // 2, cols])
    return np.where(count > 0, median, np.nan)


class Recent:
    """The last ``size`` accepted values per column, whose median is computed only when asked for.

    For a second opinion on the rare flagged value (is it a jump from the short-term level, or a
    slow trend?): one row write per step, a small sort only for the columns asked about.
    """

    def __init__(self, size: int, width: int) -> None:
        self.size = size
        self.buf = np.full((size, width), np.nan)
        self.filled = 0

    def update(self, x: np.ndarray | float, mask: np.ndarray | bool) -> None:
        """Append one row: ``x`` where ``mask`` (the caller's: only finite values), a gap elsewhere."""
        if isinstance(x, float):
            self.buf[self.filled % self.size] = x if mask else math.nan
        elif mask is True:
            self.buf[self.filled % self.size] = x
        else:
            self.buf[self.filled % self.size] = np.where(mask, x, np.nan)
        self.filled += 1

    def median(self, cols: np.ndarray, least: int) -> np.ndarray:
        """The median of each column of ``cols``; NaN for a column with fewer than ``least`` values."""
        rows = self.buf[: min(self.filled, self.size)][:, cols]
        count = np.sum(~np.isnan(rows), axis=0)
        return np.where(count >= least, _nanmedian(rows, count), np.nan)


class Values:
    """The recent level and the spread of one number, from its last ``size`` accepted values.

    ``center`` is the median of the last 10 values (the current level, so that a trend does not
    drag it); ``spread`` is the larger of 1.4826 x the MAD of the last 20 values (recent enough
    that a long trend does not widen it) and the step-to-step noise, 1.4826 x the median
    absolute difference of consecutive values over sqrt(2). Plain Python: a few numpy calls on
    tiny arrays cost more than the whole computation. The statistics are recomputed every
    ``refresh`` values (and on each of the first few).
    """

    def __init__(self, size: int, refresh: int = 10) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.refresh = refresh
        self.center = math.nan
        self.spread = math.nan
        self.count = 0
        self._updates = 0

    def update(self, x: float) -> None:
        """Append an accepted (finite) value."""
        self.values.append(x)
        self._updates += 1
        if self._updates >= self.refresh or len(self.values) < 5:
            self._updates = 0
            values = list(self.values)
            self.count = len(values)
            self.center = _median_of(values[-10:])
            recent = values[-20:]
            middle = _median_of(recent)
            mad = 1.4826 * _median_of([abs(v - middle) for v in recent])
            steps = [abs(b - a) for a, b in zip(values, values[1:])]
            self.spread = max(mad, 1.4826 * _median_of(steps) / math.sqrt(2.0) if steps else 0.0)


def _median_of(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
