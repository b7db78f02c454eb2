"""Detector ``update_ratio``: updates far too large or too small relative to the weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_LOW
from gradwatch.findings import Finding
from gradwatch.records import StepRecord
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
    _high: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)
    _low: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive sampled steps out of range, per layer."""
        ratio = record.vector("update_ratio")
        grad = record.vector("grad_norm")
        if record.skipped or ratio is None or grad is None:
            return []
        bad = record.vector("grad_nonfinite")
        if bad is not None and (bad > 0).any():
            return []
        lr = record.scalars.get("lr")
        layout = record.layout
        out = []
        for i in np.flatnonzero(np.isfinite(ratio) & np.isfinite(grad)):
            key, r = (layout.version, int(i)), float(ratio[i])
            high = r > self.high
            low = 0 < r < self.low and grad[i] > 0 and lr != 0  # exactly 0: unoptimized_parameter's
            self._high[key] = self._high.get(key, 0) + 1 if high else 0
            self._low[key] = self._low.get(key, 0) + 1 if low else 0
            name, type_ = layout.layers[i], layout.layer_types[i]
            if self._high[key] == self.patience:
                message = (f"update of {_layer(name, type_)} is {r:.3g}x its weights' norm at step {record.step}: "
                           "too large.")
                out.append(self.finding(record, "warning", name, message, value=r, data={"hint": HINT_HIGH}))
            if self._low[key] == self.patience_low and not self.causes.named(LR_LOW, record.step):
                message = (f"update of {_layer(name, type_)} is only {r:.3g}x its weights' norm at step "
                           f"{record.step}, although it has a gradient: it does not learn.")
                out.append(self.finding(record, "warning", name, message, value=r, data={"hint": HINT_LOW}))
        return out
