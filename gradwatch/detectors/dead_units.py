"""Detector ``dead_units``: a layer's activations are (almost) all zero for a sustained period."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.findings import Finding
from gradwatch.records import StepRecord, present
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "a large negative bias or a too-high learning rate killed the units: re-initialise the bias, "
    "lower the learning rate, or use LeakyReLU/GELU"
)


@dataclass
class DeadUnits(Detector):
    """A leaf whose fraction of exactly-zero outputs is at least ``threshold`` on ``patience``
    sampled steps in a row (activations are measured on sampled steps).

    Attributes:
        threshold: fraction of zero outputs that counts as dead.
        patience: consecutive sampled steps before it is reported.
    """

    kind = "dead_units"
    bounds = {"threshold": Bound(0, 1, open_low=True), "patience": Bound(1)}
    threshold: float = 0.99
    patience: int = 2
    _runs: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False)

    metric = "act_zero_frac"
    hint = HINT

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive sampled steps at or above the threshold, per leaf."""
        values = record.vector(self.metric)
        if record.skipped or values is None:
            return []
        seen = present(record, "layer", self.metric)
        out = []
        layout = record.layout
        for i in np.flatnonzero(seen):
            key = (layout.version, int(i))
            hit = bool(values[i] >= self.threshold)
            self._runs[key] = self._runs.get(key, 0) + 1 if hit else 0
            if self._runs[key] == self.patience:
                name = layout.layers[i]
                message = self.describe(name, layout.layer_types[i], float(values[i]))
                out.append(self.finding(record, "warning", name, message, value=float(values[i]),
                                        data={"hint": self.hint}))
        return out

    def describe(self, name: str, type_: str, value: float) -> str:
        """The finding's message."""
        return (f"{value:.1%} of the outputs of {_layer(name, type_)} are exactly zero on "
                f"{plural(self.patience, 'sampled step')} in a row: its units are dead.")
