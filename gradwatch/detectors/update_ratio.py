"""Detector ``update_ratio``: updates far too large or too small relative to the weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH, LR_LOW
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.wording import layer as _layer

HINT_HIGH = "the step rewrites the weights wholesale: lower the learning rate (a healthy ratio is around 1e-3)"
HINT_LOW = "the weights barely move: raise the learning rate, or check that the optimizer holds this layer"


@dataclass
class UpdateRatio(Detector):
    """||delta w|| / ||w|| of the applied update, per layer, on sampled steps (known one step later).

    Attributes:
        high: a ratio above this on ``patience`` sampled steps in a row is too large.
        low: a ratio below this (with a non-zero gradient and learning rate) on
            ``patience_low`` sampled steps in a row is a useless update.
        patience: consecutive sampled steps for a too-large ratio.
        patience_low: consecutive sampled steps for a too-small ratio.
    """

    kind = "update_ratio"
    late = True
    bounds = {"high": Bound(0, open_low=True), "low": Bound(0, "high", open_high=True), "patience": Bound(1),
              "patience_low": Bound(1)}
    high: float = 1.0
    low: float = 1e-8
    patience: int = 2
    patience_low: int = 3
    _high: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _low: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive sampled steps out of range, per layer (a layer without a ratio keeps its count)."""
        ratio = record.vector("update_ratio")
        grad = record.vector("grad_norm")
        if record.skipped or ratio is None or grad is None:
            return []
        bad = record.vector("grad_nonfinite")
        if bad is not None and (bad > 0).any():
            return []
        lr = record.scalars.get("lr")
        layout = record.layout
        if layout.version != self._version:
            self._version = layout.version
            self._high, self._low = np.zeros(len(ratio), dtype=np.int64), np.zeros(len(ratio), dtype=np.int64)
        seen = np.isfinite(ratio) & np.isfinite(grad)
        high = seen & (ratio > self.high)
        low = seen & (ratio > 0) & (ratio < self.low) & (grad > 0) & (lr != 0)  # exactly 0: unoptimized_parameter's
        self._high = np.where(high, self._high + 1, np.where(seen, 0, self._high))
        self._low = np.where(low, self._low + 1, np.where(seen, 0, self._low))
        out = []
        for i in np.flatnonzero(high & (self._high == self.patience)):
            name, type_, r = layout.layers[i], layout.layer_types[i], float(ratio[i])
            message = (f"update of {_layer(name, type_)} is {r:.3g}x its weights' norm at step {record.step}: "
                       "too large.")
            out.append(self.finding(record, "warning", name, message, value=r, data={"hint": HINT_HIGH}))
        if self.causes.named(LR_LOW, record.step) or self.causes.named(LR_HIGH, record.step):
            return out  # named already, or the weights a too-high rate blew up round their updates away
        for i in np.flatnonzero(low & (self._low == self.patience_low)):
            name, type_, r = layout.layers[i], layout.layer_types[i], float(ratio[i])
            message = (f"update of {_layer(name, type_)} is only {r:.3g}x its weights' norm at step "
                       f"{record.step}, although it has a gradient: it does not learn.")
            out.append(self.finding(record, "warning", name, message, value=r, data={"hint": HINT_LOW}))
        return out
