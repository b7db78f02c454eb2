"""Relayout (open stage): the watched model's parameters change while it trains, and the layout follows.

A layer added or replaced, or parameters frozen or unfrozen after ``gw.watch`` (a fine-tuning loop
that unfreezes its backbone), change which parameters there are and which are trained: the
detectors judge a parameter that requires grad and gets none (``unused_parameter``), or one that
gets a gradient and is not updated (``unoptimized_parameter``), by the layout. Looking costs one
re-discovery of the model, so it is done when there is a sign: the parameters without a gradient
are not those of the last look (and at the first step).
"""

from __future__ import annotations

from torch import nn

from gradwatch.errors import ConfigError
from gradwatch.step.layout import Discovered, discover


def rediscovered(model: nn.Module, found: Discovered) -> Discovered | None:
    """The model's layout now (the next version), or None when it is ``found``'s: the same layers, the
    same parameter objects under the same names, the same of them requiring grad; None also while
    every parameter is frozen (the layout stays as it was).
    """
    try:
        now = discover(model, version=found.layout.version + 1)
    except ConfigError:
        return None
    same = (now.layout.layers, now.layout.params, now.layout.trainable) == (
        found.layout.layers, found.layout.params, found.layout.trainable)
    return None if same and all(a is b for a, b in zip(now.params, found.params)) else now


class Looks:
    """When to look at the layout again: at the first step, then when the parameters without a
    gradient are not those of the last look, at most once per ``period`` steps.
    """

    def __init__(self, period: int) -> None:
        self.period = period
        self._missing: tuple[int, ...] | None = None
        self._at = -period

    def due(self, missing: tuple[int, ...], step: int) -> bool:
        """Whether to look now, given the parameters (indices) without a gradient at the latest step."""
        if missing == self._missing or step < self._at + self.period:
            return False
        self._missing, self._at = missing, step
        return True
