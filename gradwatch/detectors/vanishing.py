"""Detector ``vanishing``: a layer's gradient is negligible, absolutely or relative to the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.store.findings import Finding
from gradwatch.store.records import Layout, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "use a non-saturating activation (ReLU/GELU) instead of sigmoid/tanh in deep stacks, a scaled "
    "initialisation (He/Xavier), normalisation layers or residual connections"
)
HINT_ZERO = (
    "something after this layer passes no gradient back: a ReLU (often a functional F.relu) that zeroes "
    "all of its outputs, a multiplication by zero, a mask, or a .detach() on one of two paths"
)
#: a leaf with at least this fraction of exactly-zero outputs is dead (as ``dead_units`` judges it)
DEAD = 0.99


@dataclass
class Vanishing(Detector):
    """A layer whose gradient RMS (norm / sqrt(numel)) stays below ``absolute``, or below
    ``relative`` times the median RMS of the layers, for ``patience`` steps in a row.

    One root cause, one finding: layers whose gradients are exactly zero (not small: no gradient
    flows back to them) are one finding, at the last of them in model order (the cut is after
    it); a gradient that is exactly zero while a leaf of the model is dead (its outputs all zero
    on the latest sampled step) is a consequence that ``dead_units`` reports, and so is any
    small gradient within 100 steps of a too-high learning rate named by another detector (it
    saturates and kills units); a step whose gradients are all exactly zero is ``zero_gradient``'s, and one whose
    gradient norm overflows is ``exploding``'s.

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
    _layout: Layout | None = field(default=None, init=False, repr=False)  # the layout of the latest version
    _scale: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False, repr=False)  # 1/sqrt(numel)
    _sized: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)
    _dead: bool = field(default=False, init=False, repr=False)  # a leaf was dead on the latest sampled step
    _counting: bool = field(default=False, init=False, repr=False)  # some layer's count is above 0

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive negligible steps per layer; report a layer when it reaches patience."""
        norm = record.vector("grad_norm")
        if record.skipped or norm is None:
            return []
        layout = record.layout
        if layout.version != self._version:  # counts carry over a new layout of the same layers (frozen, unfrozen)
            numel = np.asarray(layout.layer_numel, dtype=np.float64)
            if not layout.same_layers(self._layout):
                self._runs = np.zeros(len(layout.layers), dtype=np.int64)
            self._version, self._layout = layout.version, layout
            self._scale, self._sized = 1.0 / np.sqrt(np.maximum(numel, 1.0)), numel > 0
        finite = record.gradients_finite()  # then so is every layer's norm
        if not finite:
            bad = record.vector("grad_nonfinite")
            if bad is not None and (bad > 0).any():
                return []  # a non-finite step is the nonfinite detector's
        zeros = record.vector("act_zero_frac")
        if zeros is not None:
            self._dead = bool((zeros >= DEAD).any())  # NaN (leaf not called) compares False
        rms = norm.astype(np.float64) * self._scale
        if not finite and np.isinf(rms).any():
            return []  # an overflowing gradient norm is the exploding detector's
        has = np.isfinite(rms) & self._sized
        measured = rms[has]
        if len(measured):
            low = measured.min()
            # the median is at most the largest: a smallest RMS above both bounds leaves nothing small
            if low > 0 and low >= max(self.absolute, self.relative * measured.max()):
                self._reset(has)
                return []
        positive = rms[has & (rms > 0)]
        if not len(positive):
            self._runs[:] = 0  # every gradient exactly zero: the zero_gradient detector's
            return []
        median = _median(positive)
        small = has & (rms < max(self.absolute, self.relative * median))
        if self.causes.named(LR_HIGH, record.step):
            small[:] = False  # a too-high learning rate saturates and kills units: its consequences
        elif self._dead:
            small &= rms > 0  # exactly zero behind dead units: their consequence
        if not small.any():  # the usual step: every count is reset where there is a gradient
            self._reset(has)
            return []
        self._runs = np.where(small, self._runs + 1, self._runs * ~has)  # a layer without a gradient keeps its count
        self._counting = True
        out = []
        due = np.flatnonzero(small & (self._runs == self.patience))
        zero = due[rms[due] == 0]
        if len(zero):  # one cut in the graph, one finding: at the last of them in model order
            i = int(zero[-1])
            names = [layout.layers[k] for k in zero]
            name, others = names[-1], len(names) - 1
            more = f" (and {plural(others, 'layer')} before it)" if others else ""
            message = (f"gradient of {_layer(name, layout.layer_types[i])}{more} has been exactly zero for "
                       f"{plural(self.patience, 'step')} while the median layer's RMS is {median:.3g}: no gradient "
                       "flows back past it.")
            out.append(self.finding(record, "warning", name, message, value=0.0,
                                    data={"rms": 0.0, "median_rms": median, "count": len(names),
                                          # from the cut backwards: the nearest 19 and the first (the input end)
                                          "layers": names[::-1] if len(names) <= 20 else [*names[:-20:-1], names[0]],
                                          "hint": HINT_ZERO}))
        for i in due[rms[due] > 0]:
            name, ratio = layout.layers[i], rms[i] / median
            message = (f"gradient of {_layer(name, layout.layer_types[i])} has vanished for "
                       f"{plural(self.patience, 'step')}: RMS {rms[i]:.3g}, {ratio:.2g}x the median layer's "
                       f"{median:.3g}.")
            out.append(self.finding(record, "warning", name, message, value=float(ratio),
                                    data={"rms": float(rms[i]), "median_rms": median, "hint": HINT}))
        return out

    def _reset(self, has: np.ndarray) -> None:
        """Nothing is small: every count is reset where there is a gradient."""
        if self._counting:
            self._runs = self._runs * ~has
            self._counting = bool(self._runs.any())


def _median(values: np.ndarray) -> float:
    """The median of a small non-empty vector (np.median's overhead is 30x a sort of 50 values)."""
    ordered = np.sort(values)
    n = len(ordered)
    return float(0.5 * (ordered[(n - 1) // 2] + ordered[n // 2]))
