"""Detector ``vanishing``: a layer's gradient is negligible, absolutely or relative to the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors import Detector
from gradwatch.findings import Finding
from gradwatch.records import StepRecord

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
    absolute: float = 1e-10
    relative: float = 1e-4
    patience: int = 10
    _runs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive negligible steps per layer; report a layer when it reaches patience."""
        norm = record.vector("grad_norm")
        if record.skipped or norm is None:
            return []
        layout = record.layout
        if layout.version != self._version:
            self._runs, self._version = np.zeros(len(layout.layers), dtype=np.int64), layout.version
        numel = np.maximum(np.asarray(layout.layer_numel, dtype=np.float64), 1.0)
        rms = norm.astype(np.float64) / np.sqrt(numel)
        bad = record.vector("grad_nonfinite")
        if bad is not None and np.nansum(bad) > 0:
            return []  # a non-finite step is the nonfinite detector's
        has = np.isfinite(rms) & (np.asarray(layout.layer_numel) > 0)
        positive = rms[has & (rms > 0)]
        median = float(np.median(positive)) if len(positive) else 0.0
        ratio = np.where(median > 0, rms / max(median, 1e-300), 0.0)
        small = has & ((rms < self.absolute) | (ratio < self.relative))
        self._runs = np.where(small, self._runs + 1, np.where(has, 0, self._runs))
        out = []
        for i in np.flatnonzero(small & (self._runs == self.patience)):
            name = layout.layers[i]
            message = (
                f"gradient of {name} ({layout.layer_types[i]}) has vanished for {self.patience} steps: RMS "
                f"{rms[i]:.3g}, {ratio[i]:.2g}x the median layer's {median:.3g}."
            )
            out.append(self.finding(record, "warning", name, message, value=float(ratio[i]),
                                    data={"rms": float(rms[i]), "median_rms": median, "hint": HINT}))
        return out
