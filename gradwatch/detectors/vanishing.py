"""Detector ``vanishing``: a layer's gradient is negligible, absolutely or relative to the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.findings import Finding
from gradwatch.records import StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "use a non-saturating activation (ReLU/GELU) instead of sigmoid/tanh in deep stacks, a scaled "
    "initialisation (He/Xavier), normalisation layers or residual connections"
)


@dataclass
class Vanishing(Detector):
    """A layer whose gradient RMS (norm / sqrt(numel)) stays below ``absolute``, or below
    ``relative`` times the median RMS of the layers, for ``patience`` steps in a row.

    Attributes:
        absolute: RMS below this is negligible whatever the other layers do.
        relative: RMS below this fraction of the median layer's RMS is negligible.
        patience: consecutive steps (with a gradient) before it is reported.
    """

    kind = "vanishing"
    bounds = {"relative": Bound(0, 1), "patience": Bound(1)}
    absolute: float = 1e-10
    relative: float = 1e-4
    patience: int = 10
    _runs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)
    _scale: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False, repr=False)  # 1/sqrt(numel)
    _sized: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive negligible steps per layer; report a layer when it reaches patience."""
        norm = record.vector("grad_norm")
        if record.skipped or norm is None:
            return []
        layout = record.layout
        if layout.version != self._version:
            numel = np.asarray(layout.layer_numel, dtype=np.float64)
            self._runs, self._version = np.zeros(len(layout.layers), dtype=np.int64), layout.version
            self._scale, self._sized = 1.0 / np.sqrt(np.maximum(numel, 1.0)), numel > 0
        bad = record.vector("grad_nonfinite")
        if bad is not None and (bad > 0).any():
            return []  # a non-finite step is the nonfinite detector's
        rms = norm.astype(np.float64) * self._scale
        has = np.isfinite(rms) & self._sized
        positive = rms[has & (rms > 0)]
        median = _median(positive) if len(positive) else 0.0
        # below `absolute`, or below `relative` x the median (everything, when the median is 0)
        limit = max(self.absolute, self.relative * median) if median > 0 else np.inf
        small = has & (rms < limit)
        self._runs = np.where(small, self._runs + 1, self._runs * ~has)  # a layer without a gradient keeps its count
        out = []
        for i in np.flatnonzero(small & (self._runs == self.patience)):
            name, ratio = layout.layers[i], rms[i] / median if median > 0 else 0.0
            message = (
                f"gradient of {_layer(name, layout.layer_types[i])} has vanished for "
                f"{plural(self.patience, 'step')}: RMS "
                f"{rms[i]:.3g}, {ratio:.2g}x the median layer's {median:.3g}."
            )
            out.append(self.finding(record, "warning", name, message, value=float(ratio),
                                    data={"rms": float(rms[i]), "median_rms": median, "hint": HINT}))
        return out


def _median(values: np.ndarray) -> float:
    """The median of a small non-empty vector (np.median's overhead is 30x a sort of 50 values)."""
    ordered = np.sort(values)
    n = len(ordered)
    return float(0.5 * (ordered[(n - 1) // 2] + ordered[n // 2]))
