"""Detector ``dead_units``: a layer's activations are (almost) all zero for a sustained period."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, StepRecord, present
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "a large negative bias or a too-high learning rate killed the units: re-initialise the bias, "
    "lower the learning rate, or use LeakyReLU/GELU"
)
#: leaves that are not activations and output all zeros when their input is all zeros: when every
#: output of one is zero, the zeros were made before it (by a functional ReLU, for instance)
CARRIERS = frozenset({
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Identity",
    "Flatten", "Unflatten", "Upsample", "PixelShuffle", "PixelUnshuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
})


def _carrier(type_: str) -> bool:
    """Whether a leaf of this type only carries zeros: a parametrized ``Linear`` (weight_norm's or a
    sparsifier's ``ParametrizedLinear``) does as a ``Linear`` does.
    """
    return type_.removeprefix("Parametrized") in CARRIERS


@dataclass
class DeadUnits(Detector):
    """A leaf whose fraction of exactly-zero outputs is at least ``threshold`` on ``patience``
    sampled steps in a row (activations are measured on sampled steps).

    The finding names the layer whose units died: when the dead leaf only carries zeros made
    before it (a ``Dropout``, a pooling or a bias-free ``Conv2d`` after a functional ``F.relu``),
    that is the nearest leaf before it in model order that still ran with non-zero outputs and
    gets an exactly-zero gradient: its outputs are all negative and the ReLU after it zeroes them.
    A leaf with weights is taken to carry zeros only when the autograd graph shows that its input
    was all zeros: its weights got an exactly-zero gradient (a weight's gradient is its input times
    the output's gradient) and are not all zero themselves. A ``Linear`` whose weights are all
    exactly zero (LoRA's ``lora_B`` at its initialisation) makes its zeros itself: it is neither a
    carrier nor dead (its units never lived; a zero layer that never changes is
    ``unoptimized_parameter``'s), and the leaf before it is not blamed.
    The layers that get exactly-zero gradients because of it are named in the same finding
    (``vanishing`` does not report them).

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
    #: name the layer that made the zeros rather than a leaf that only carries them
    attributes = True

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive sampled steps at or above the threshold, per leaf."""
        values = record.vector(self.metric)
        if record.skipped or values is None:
            return []
        seen = present(record, "layer", self.metric)
        out: dict[int, Finding] = {}
        layout = record.layout
        weights = record.vector("param_norm")
        for leaf in np.flatnonzero(seen):
            key = (layout.version, int(leaf))
            zero_layer = weights is not None and layout.layer_numel[leaf] > 0 and weights[leaf] == 0
            hit = bool(values[leaf] >= self.threshold) and not zero_layer  # zero weights make zeros by design
            self._runs[key] = self._runs.get(key, 0) + 1 if hit else 0
            if self._runs[key] != self.patience:
                continue
            i = int(leaf)
            cause = self._maker(record, i, values, seen) if self.attributes else None
            if cause is not None and values[cause] >= self.threshold:  # a dead leaf before it made the zeros
                i, cause = cause, None  # (an nn.ReLU before a Dropout): that leaf's finding
            at = i if cause is None else cause
            if at in out:
                continue  # several leaves carry the zeros of one layer: one finding
            name, type_ = layout.layers[i], layout.layer_types[i]
            if cause is None:
                message = self.describe(name, type_, float(values[i]))
            else:
                message = (f"every output of {_layer(layout.layers[at], layout.layer_types[at])} is zeroed by the "
                           f"ReLU applied after it (a functional F.relu: {values[i]:.1%} of what reaches "
                           f"{_layer(name, type_)} is exactly zero) on {plural(self.patience, 'sampled step')} in a "
                           "row, and it gets no gradient: its units are dead.")
            data: dict[str, object] = {"hint": self.hint}
            if self.attributes:
                cut = self._cut_off(record, at)
                if cut:
                    message = message[:-1] + f"; no gradient reaches {', '.join(_layer(c) for c in cut[:3])}" + (
                        f" and {plural(len(cut) - 3, 'more layer')}." if len(cut) > 3 else ".")
                data.update({"zeroed_in": name if cause is not None else None, "no_gradient": cut[:20]})
            out[at] = self.finding(record, "warning", layout.layers[at], message, value=float(values[i]), data=data)
        return list(out.values())

    def _maker(self, record: StepRecord, i: int, values: np.ndarray, seen: np.ndarray) -> int | None:
        """The leaf whose outputs a functional ReLU zeroed before they reached carrier leaf ``i``, if found."""
        layout = record.layout
        grad = record.vector("grad_norm")
        if not _carrier(layout.layer_types[i]) or grad is None or not self._fed_zeros(record, i):
            return None
        before = [j for j in layout.leaves if j < i and seen[j]]
        for j in reversed(before):
            if values[j] >= self.threshold:
                if not _carrier(layout.layer_types[j]):
                    return j  # the zeros were made by that leaf (an nn.ReLU): its own finding says so
                continue  # carries the same zeros
            return j if layout.layer_numel[j] > 0 and grad[j] == 0 else None
        return None

    @staticmethod
    def _fed_zeros(record: StepRecord, i: int) -> bool:
        """Whether the autograd graph shows that leaf ``i``'s input was all zeros: true for a leaf
        without weights (nothing to tell by), else its weights are not all zero and got an exactly-zero
        gradient (the gradient of a weight is its input times the output's gradient: an input that was
        not all zeros gives one, as ``lora_A``'s outputs do to a ``lora_B`` still at zero); frozen
        weights (no gradient) tell nothing.
        """
        layout = record.layout
        if layout.layer_numel[i] == 0:
            return True
        weights = record.vector("param_norm")
        if weights is None or not weights[i] > 0:
            return False
        grads = record.vector("grad_norm", PARAM)
        own = [p for layer, p in layout.owners if layer == i and not layout.params[p].endswith("bias")]
        if grads is None or not own:
            layer_grad = record.vector("grad_norm")
            return layer_grad is not None and layer_grad[i] == 0
        return all(grads[p] == 0 or np.isnan(grads[p]) for p in own)  # NaN: frozen, no gradient to tell by

    @staticmethod
    def _cut_off(record: StepRecord, at: int) -> list[str]:
        """Layers other than ``at`` that own parameters and get an exactly-zero gradient."""
        grad = record.vector("grad_norm")
        if grad is None:
            return []
        numel = record.layout.layer_numel
        return [name for k, name in enumerate(record.layout.layers) if k != at and numel[k] > 0 and grad[k] == 0]

    def describe(self, name: str, type_: str, value: float) -> str:
        """The finding's message."""
        return (f"{value:.1%} of the outputs of {_layer(name, type_)} are exactly zero on "
                f"{plural(self.patience, 'sampled step')} in a row: its units are dead.")
