"""Detector ``saturation``: sigmoid/tanh outputs pinned at their limits."""

from __future__ import annotations

from dataclasses import dataclass

from gradwatch.detectors.dead_units import DeadUnits
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "inputs to the activation are too large: use a smaller initialisation, normalise before the "
    "activation, lower the learning rate, or use a non-saturating activation"
)


@dataclass
class Saturation(DeadUnits):
    """A bounded leaf (Sigmoid, Tanh, Hardtanh ...) with at least ``threshold`` of its outputs
    within 1% of the output range from a bound, on ``patience`` sampled steps in a row.

    Attributes:
        threshold: saturated fraction that is reported.
        patience: consecutive sampled steps before it is reported.
    """

    kind = "saturation"
    threshold: float = 0.9
    patience: int = 2

    metric = "act_sat_frac"
    hint = HINT
    attributes = False

    def describe(self, name: str, type_: str, value: float) -> str:
        """The finding's message."""
        return (f"{value:.1%} of the outputs of {_layer(name, type_)} are saturated at its bounds on "
                f"{plural(self.patience, 'sampled step')} in a row: its gradients vanish.")
