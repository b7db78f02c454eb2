"""Aggregate: per-parameter numbers into per-layer numbers, on the host with numpy."""

from __future__ import annotations

import math

import numpy as np

from gradwatch.store.records import Layout

#: layers x parameters up to which the usual step's sums are a matrix-vector product (2 MiB of float64)
DENSE = 1 << 18


class Aggregator:
    """Combines parameter-level vectors into layer-level vectors for one layout.

    A layer's value is NaN when none of its parameters has a value (``has`` is False for all),
    so "no gradient" stays distinguishable from a real non-finite gradient, which propagates.
    """

    def __init__(self, layout: Layout) -> None:
        own = np.asarray(layout.owners, dtype=np.int64).reshape(-1, 2)
        self._layer, self._param = own[:, 0], own[:, 1]
        self._n = len(layout.layers)
        #: ``has`` for a step where every parameter has a value (the usual step: cheaper)
        self.every = np.ones(len(layout.params), dtype=bool)
        self._owning = self._count(self.every) > 0  # layers that own a parameter
        #: the usual step's sums over a model of modest size: one matrix-vector product (layers x
        #: parameters, how many times each layer owns each parameter) instead of a scatter
        self._matrix: np.ndarray | None = None
        if self._n * len(layout.params) <= DENSE:
            self._matrix = np.zeros((self._n, len(layout.params)))
            np.add.at(self._matrix, (self._layer, self._param), 1.0)
        #: a layer's non-finite count on a step where every parameter has a finite gradient
        self.zeros = np.where(self._owning, 0.0, np.nan).astype(np.float32)
        self.zeros.flags.writeable = False

    def _count(self, has: np.ndarray) -> np.ndarray:
        return np.bincount(self._layer, weights=has[self._param].astype(np.float64), minlength=self._n)

    def _some(self, has: np.ndarray) -> np.ndarray:
        """Layers with at least one parameter that has a value."""
        return self._owning if has is self.every else self._count(has) > 0

    def norm(self, norms: np.ndarray, has: np.ndarray) -> np.ndarray:
        """Layer L2 norm from parameter L2 norms: sqrt of the sum of squares."""
        if has is self.every and self._matrix is not None:
            values = norms.astype(np.float64, copy=False)
            sq = values * values
            if math.isfinite(sq.sum()):  # a NaN would reach every layer through the product
                return np.where(self._owning, np.sqrt(self._matrix @ sq), np.nan)
        sq = norms.astype(np.float64) ** 2 if has is self.every else np.where(has, norms.astype(np.float64) ** 2, 0.0)
        total = np.bincount(self._layer, weights=sq[self._param], minlength=self._n)
        return np.where(self._some(has), np.sqrt(total), np.nan)

    def sum(self, values: np.ndarray, has: np.ndarray) -> np.ndarray:
        """Layer sum of parameter values."""
        v = values.astype(np.float64) if has is self.every else np.where(has, values.astype(np.float64), 0.0)
        total = np.bincount(self._layer, weights=v[self._param], minlength=self._n)
        return np.where(self._some(has), total, np.nan)

    def max(self, values: np.ndarray, has: np.ndarray) -> np.ndarray:
        """Layer maximum of parameter values (NaN propagates)."""
        out = np.full(self._n, -np.inf)
        with np.errstate(invalid="ignore"):  # a NaN gradient makes its layer's maximum NaN
            np.maximum.at(out, self._layer, np.where(has, values.astype(np.float64), -np.inf)[self._param])
        return np.where(self._some(has), out, np.nan)
