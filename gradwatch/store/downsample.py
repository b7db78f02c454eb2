"""Downsampling for people: fewer points on the step axis, with every extreme kept.

Two shapes, both NaN-aware:

- :func:`minmax` thins a 1-D series (a curve) to at most ``max_points`` points. It keeps the
  first and the last point and, in each bucket of consecutive points, the smallest and the largest
  value, so a spike (or a dip) never disappears; a bucket holding a NaN keeps one NaN too, so a gap
  in the line survives.
- :func:`columns` (and the streaming :class:`Columns` behind it) caps the step columns of a
  2-D table (steps x layers, the shape of ``Run.matrix``) for a heatmap. Steps are grouped into
  equal ranges of the step axis and each group is reduced per layer by ``"max"`` — the value of
  largest magnitude, sign kept (default: for norms, ratios and fractions the worst moment of the
  bucket is what a reader needs to see) — or ``"mean"``. Non-finite values are left out of both
  reductions; a bucket with no finite value for a layer is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

REDUCTIONS = ("max", "mean")


def minmax(steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray,
           max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Thin a series to at most ``max_points`` points, keeping first, last and per-bucket extrema.

    Args:
        steps: the step of each value, ascending.
        values: the series; NaN and infinities are allowed.
        max_points: the most points to return (at least 4).

    Returns:
        ``(steps, values)`` as new arrays, in step order. A series of at most ``max_points`` points
        comes back unchanged (copied).
    """
    s = np.asarray(steps)
    v = np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps and values must be 1-D of one length, got {s.shape} and {v.shape}")
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    n = len(v)
    if n <= max_points:
        return s.copy(), v.copy()
    nan = np.isnan(v)
    per_bucket = 3 if nan.any() else 2
    buckets = (max_points - 2) // per_bucket
    if buckets == 0:  # no room for a NaN beside the extremes
        per_bucket, buckets = 2, 1
    edges = np.linspace(1, n - 1, buckets + 1).astype(np.int64)
    keep = [0, n - 1]
    # +inf / -inf are real extremes here; NaN is neither the minimum nor the maximum
    low = np.where(nan, np.inf, v)
    high = np.where(nan, -np.inf, v)
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        if nan[a:b].all():
            keep.append(a)
            continue
        keep.append(a + int(np.argmin(low[a:b])))
        keep.append(a + int(np.argmax(high[a:b])))
        if per_bucket == 3 and nan[a:b].any():
            keep.append(a + int(np.argmax(nan[a:b])))
    idx = np.unique(np.asarray(keep, dtype=np.int64))
    return s[idx], v[idx]


def bucket_starts(first: int, last: int, max_columns: int) -> np.ndarray:
    """Start steps of at most ``max_columns`` equal ranges covering ``first..last`` (inclusive)."""
    if max_columns < 1:
        raise ValueError(f"max_columns must be at least 1, got {max_columns}")
    span = last - first + 1
    if span <= max_columns:
        return np.arange(first, last + 1, dtype=np.int64)
    return np.unique(np.floor(np.linspace(first, last + 1, max_columns + 1)[:-1]).astype(np.int64))


class Columns:
    """Streaming column reduction of a steps x entries table into fixed step buckets.

    Feed chunks of rows in any order with :meth:`add`; :meth:`result` gives the reduced table.
    Memory is one row per bucket, whatever the number of steps.

    Args:
        starts: ascending start steps of the buckets (from :func:`bucket_starts`); a step belongs
            to the last bucket whose start is not after it.
        width: entries per row (layers).
        how: ``"max"`` (value of largest magnitude, sign kept) or ``"mean"``.
    """

    def __init__(self, starts: np.ndarray, width: int, how: str = "max") -> None:
        if how not in REDUCTIONS:
            raise ValueError(f"unknown reduction {how!r}; valid reductions are: {', '.join(REDUCTIONS)}")
        self.starts = np.asarray(starts, dtype=np.int64)
        self.how = how
        n = len(self.starts)
        self._best = np.full((n, width), np.nan)
        self._sum = np.zeros((n, width))
        self._count = np.zeros((n, width), dtype=np.int64)
        self._seen = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)

    def add(self, steps: np.ndarray | Sequence[int], rows: np.ndarray) -> None:
        """Fold rows (one per step, ``width`` entries each) into their buckets."""
        s = np.asarray(steps, dtype=np.int64)
        values = np.asarray(rows)
        if values.dtype not in (np.float32, np.float64):
            values = values.astype(np.float64)
        bucket = np.searchsorted(self.starts, s, side="right") - 1
        inside = bucket >= 0
        if not inside.all():
            bucket, s, values = bucket[inside], s[inside], values[inside]
        if len(s) == 0:
            return
        if (np.diff(bucket) < 0).any():
            order = np.argsort(bucket, kind="stable")
            bucket, s, values = bucket[order], s[order], values[order]
        heads = np.flatnonzero(np.concatenate([[True], np.diff(bucket) != 0]))
        ids = bucket[heads]  # distinct, ascending
        self._seen[ids] = np.minimum(self._seen[ids], np.minimum.reduceat(s, heads))
        finite = np.isfinite(values)
        if self.how == "mean":
            self._sum[ids] += np.add.reduceat(np.where(finite, values, 0.0), heads, axis=0, dtype=np.float64)
            self._count[ids] += np.add.reduceat(finite, heads, axis=0, dtype=np.int64)
            return
        clean = np.where(finite, values, np.nan)
        high = np.fmax.reduceat(clean, heads, axis=0)  # NaN only where a bucket has no finite value
        low = np.fmin.reduceat(clean, heads, axis=0)
        pick = np.where(np.abs(low) > np.abs(high), low, high).astype(np.float64)
        current = self._best[ids]
        better = ~np.isnan(pick) & (np.isnan(current) | (np.abs(pick) > np.abs(current)))
        self._best[ids] = np.where(better, pick, current)

    def result(self, drop_empty: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The reduced table: ``(steps, table)`` with one row per bucket.

        ``steps`` is the first step actually seen in each bucket (its start when none was).
        With ``drop_empty``, buckets that received no step at all are left out.
        """
        if self.how == "mean":
            with np.errstate(invalid="ignore", divide="ignore"):
                table = np.where(self._count > 0, self._sum / np.maximum(self._count, 1), np.nan)
        else:
            table = self._best.copy()
        seen = self._seen != np.iinfo(np.int64).max
        steps = np.where(seen, self._seen, self.starts)
        if drop_empty:
            return steps[seen], table[seen]
        return steps, table


def columns(steps: Sequence[int] | np.ndarray, table: np.ndarray, max_columns: int,
            how: str = "max") -> tuple[np.ndarray, np.ndarray]:
    """Cap a steps x entries table at ``max_columns`` rows of steps (heatmap columns).

    Args:
        steps: ascending step of each row.
        table: 2-D array, one row per step (the layout of ``Run.matrix``).
        max_columns: the most step buckets to return.
        how: ``"max"`` (value of largest magnitude in the bucket, sign kept) or ``"mean"``;
            both leave non-finite values out.

    Returns:
        ``(steps, table)``: the first step of each non-empty bucket and the reduced rows. A table
        of at most ``max_columns`` rows comes back unchanged (copied).
    """
    s = np.asarray(steps, dtype=np.int64)
    t = np.asarray(table, dtype=np.float64)
    if t.ndim != 2 or len(s) != t.shape[0]:
        raise ValueError(f"table must be 2-D with one row per step, got {t.shape} for {len(s)} steps")
    if len(s) <= max_columns:
        return s.copy(), t.copy()
    reducer = Columns(bucket_starts(int(s.min()), int(s.max()), max_columns), t.shape[1], how)
    reducer.add(s, t)
    return reducer.result()


class Envelope:
    """The low and high of every entry (layer) per bucket of steps, for a table that keeps growing.

    Buckets are ``scale`` steps wide, anchored at step 0; when a step falls past the last of the
    ``capacity`` buckets, the scale doubles and neighbouring buckets merge, so memory stays
    ``2 x capacity x width`` float32 whatever the number of steps. Folding a row twice changes
    nothing (low and high are idempotent), so a reader may re-read a range it already added.
    Non-finite values are left out; a bucket with no finite value for an entry is NaN.

    Args:
        width: entries per row (layers).
        capacity: the most buckets kept (a power of two).
    """

    def __init__(self, width: int, capacity: int = 1024) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two of at least 2, got {capacity}")
        self.width = width
        self.capacity = capacity
        self.scale = 1
        self.low = np.full((capacity, width), np.nan, dtype=np.float32)
        self.high = np.full((capacity, width), np.nan, dtype=np.float32)
        self.filled = np.zeros(capacity, dtype=bool)  # a step (finite or not) fell in the bucket
        self.last = -1  # the largest step added

    @property
    def nbytes(self) -> int:
        """Memory held by the buckets."""
        return self.low.nbytes + self.high.nbytes + self.filled.nbytes

    def _grow(self, step: int) -> None:
        while step // self.scale >= self.capacity:
            half = self.capacity // 2
            with np.errstate(invalid="ignore"):
                for table, reduce in ((self.low, np.fmin), (self.high, np.fmax)):
                    pairs = table.reshape(half, 2, self.width)
                    table[:half] = reduce(pairs[:, 0], pairs[:, 1])
                    table[half:] = np.nan
            self.filled[:half] = self.filled.reshape(half, 2).any(axis=1)
            self.filled[half:] = False
            self.scale *= 2

    def add(self, steps: np.ndarray | Sequence[int], rows: np.ndarray) -> None:
        """Fold rows (one per step, ``width`` entries each; steps not negative) into their buckets."""
        s = np.asarray(steps, dtype=np.int64)
        if not len(s):
            return
        if s.min() < 0:
            raise ValueError("steps must not be negative")
        values = np.asarray(rows, dtype=np.float32)
        if values.shape != (len(s), self.width):
            raise ValueError(f"rows must be {len(s)} x {self.width}, got {values.shape}")
        self._grow(int(s.max()))
        self.last = max(self.last, int(s.max()))
        bucket = s // self.scale
        order = np.argsort(bucket, kind="stable")
        bucket, values = bucket[order], values[order]
        heads = np.flatnonzero(np.concatenate([[True], np.diff(bucket) != 0]))
        ids = bucket[heads]
        clean = np.where(np.isfinite(values), values, np.nan)
        with np.errstate(invalid="ignore"):
            self.low[ids] = np.fmin(self.low[ids], np.fmin.reduceat(clean, heads, axis=0))
            self.high[ids] = np.fmax(self.high[ids], np.fmax.reduceat(clean, heads, axis=0))
        self.filled[ids] = True

    def view(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The buckets that hold steps in ``start..stop-1``: ``(first step of each, low, high)``.

        Buckets no step fell in are left out. A bucket at either end may also hold steps just
        outside the range (buckets are ``scale`` steps wide).
        """
        first = max(0, start) // self.scale
        end = self.capacity if stop is None else min(self.capacity, max(0, stop - 1) // self.scale + 1)
        ids = np.arange(first, max(first, end))
        ids = ids[self.filled[ids]]
        return ids * self.scale, self.low[ids], self.high[ids]


def largest(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per cell, whichever of ``low`` and ``high`` is larger in magnitude (sign kept; NaN where both are)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(high) | (np.abs(low) > np.abs(high)), low, high)
