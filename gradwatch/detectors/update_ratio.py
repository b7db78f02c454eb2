"""Detector ``update_ratio``: updates far too large or too small relative to the weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH, LR_LOW
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import listed

HINT_HIGH = "the step rewrites the weights wholesale: lower the learning rate (a healthy ratio is around 1e-3)"
HINT_LOW = "the weights barely move: raise the learning rate, or check that the optimizer holds this layer"
#: layers (and their ratios) a grouped finding's data names at most
NAMED = 20


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
        too_high = np.flatnonzero(high & (self._high == self.patience))
        if len(too_high):
            out.append(self._one(record, too_high, ratio, "is {r}x its weights' norm at step {step}: too large.",
                                 "are {r}x their weights' norms at step {step}: too large.", HINT_HIGH, worst=max))
        if self.causes.named(LR_LOW, record.step) or self.causes.named(LR_HIGH, record.step):
            return out  # named already, or the weights a too-high rate blew up round their updates away
        too_low = np.flatnonzero(low & (self._low == self.patience_low))
        if len(too_low):
            out.append(self._one(record, too_low, ratio, "is only {r}x its weights' norm at step {step}, although it "
                                 "has a gradient: it does not learn.", "are only {r}x their weights' norms at step "
                                 "{step}, although they have gradients: they do not learn.", HINT_LOW, worst=min))
        return out

    def _one(self, record: StepRecord, flagged: np.ndarray, ratio: np.ndarray, one: str, several: str, hint: str,
             worst: Callable[[list[float]], float]) -> Finding:
        """One finding for every layer flagged alike at this step (one cause: one learning rate, one
        initialisation): its layer the first in model order, its value the worst ratio, its message and
        ``data["layers"]`` naming the layers it covers (``data["ratios"]``: theirs, in the same order).
        """
        layout = record.layout
        names = [layout.layers[i] for i in flagged]
        ratios = [float(ratio[i]) for i in flagged]
        value = worst(ratios)
        if len(names) == 1:
            message = f"update of {_layer(names[0], layout.layer_types[flagged[0]])} " + \
                one.format(r=f"{value:.3g}", step=record.step)
        else:
            low, high = min(ratios), max(ratios)
            span = f"{low:.3g}" if f"{low:.3g}" == f"{high:.3g}" else f"{low:.3g} to {high:.3g}"
            types = sorted({layout.layer_types[i] for i in flagged})
            message = (f"updates of {len(names)} layers ({listed(names)}; {', '.join(types)}) "
                       + several.format(r=span, step=record.step))
        data: dict[str, Any] = {"hint": hint}
        if len(names) > 1:
            data.update(layers=names[:NAMED], ratios=ratios[:NAMED], count=len(names))
        return self.finding(record, "warning", names[0], message, value=value, data=data)

