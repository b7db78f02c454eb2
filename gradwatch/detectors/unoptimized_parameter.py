"""Detector ``unoptimized_parameter``: a parameter that gets gradients but that no optimizer updates."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT_HELD = (
    "build the optimizer from model.parameters() (or check the name filters that split the parameters "
    "into groups: one that matches neither group drops the parameter); if it is meant to stay fixed, "
    "requires_grad_(False) saves its gradient"
)
HINT_FROZEN = (
    "build the optimizer after wrapping or freezing the model, from the parameters that require a gradient "
    "(e.g. after peft.get_peft_model: AdamW(p for p in model.parameters() if p.requires_grad))"
)
HINT_ZERO = (
    "if it is meant to be frozen, requires_grad_(False) says so and saves its gradient; otherwise check its "
    "param group: a learning rate of 0 (a typo for weight_decay=0?), or a scheduler lambda that returns 0"
)
#: the median update ratio below which an update of exactly 0 may just be rounding (float32 keeps ~7 digits)
MOVING = 1e-4
#: a parameter whose dtype's machine epsilon is above this (float16's 9.8e-4, bfloat16's 7.8e-3) rounds any
#: update below half its weights' last digit to exactly 0 (Adam at lr 1e-3 on a LayerNorm gain of 1.0 in
#: bfloat16): its updates of 0 are not judged
FINE = float(np.finfo(np.float32).eps)
#: a parameter whose gradient, relative to its weights, is below this fraction of the median one is not judged
TINY = 1e-3
#: a gradient element beyond this has a square beyond float32's largest value (3.4e38): an optimizer that keeps
#: squared gradients in float32 (Adam's second moment) turns inf there, and its update exactly 0
SQUARES = float(np.sqrt(np.finfo(np.float32).max))
#: a parameter whose dtype's machine epsilon is at most this is float64: its squares fit far beyond SQUARES
WIDE = 1e-10
HINT_SQUARES = (
    "gradients this large come from an unbounded op (exp of a log-variance, a division by a tiny number, "
    "unnormalised inputs or targets): bound it (clamp, normalise), or clip the gradients before the step"
)
#: per-parameter vector, when the record carries it: 1 where an optimizer that stepped the model holds the
#: parameter, 0 where none does
HELD = "optimizer_held"


@dataclass
class UnoptimizedParameter(Detector):
    """Parameters that require grad and get a non-zero gradient, but that no optimizer updates,
    judged on sampled steps (the update is measured there, one step later): either no optimizer
    stepping the model holds them (their update is not measured at all), whether or not the rest
    of the model moves (an optimizer built before ``peft.get_peft_model`` holds only the frozen
    base weights: nothing moves, and the adapters and the new head are in no optimizer), or their
    update is exactly zero (a param group with learning rate 0), judged while the rest of the model
    moves (its median layer's update ratio is at least 1e-4: below that, an update of exactly 0 may
    be float32 rounding of a too-low learning rate; likewise a parameter whose gradient, relative
    to its weights, is below 1e-3 of the median one is not judged; nor is the update of a parameter in
    float16 or bfloat16, which rounds any update below half its weights' last digit to 0).
    One finding for all the parameters found on the same step for the same reason, at the layer
    of the first of them; an error when the optimizers hold no trainable parameter at all (the run
    trains nothing), else a warning.

    Not being held by any optimizer is inferred from an update that was not measured; when the
    record carries the per-parameter ``optimizer_held`` vector (1 where an optimizer that stepped
    the model holds the parameter, 0 where none does), it is read from it instead (an optimizer
    that steps only on some iterations, such as a GAN's generator, also leaves an update
    unmeasured).

    Attributes:
        patience: consecutive sampled steps a parameter is not updated before it is reported.
    """

    kind = "unoptimized_parameter"
    late = True
    bounds = {"patience": Bound(1)}
    patience: int = 1
    _version: int = field(default=-1, init=False, repr=False)
    _runs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count the sampled steps on which each parameter got a gradient and was not updated."""
        ratio = record.vector("update_ratio", PARAM)
        grad = record.vector("grad_norm", PARAM)
        weights = record.vector("param_norm", PARAM)
        layout = record.layout
        if record.skipped or ratio is None or grad is None or weights is None or not len(layout.trainable):
            return []
        if layout.version != self._version:
            self._version, self._runs = layout.version, np.zeros(len(layout.params), dtype=np.int64)
        layers = record.vector("update_ratio")
        moving = layers[np.isfinite(layers) & (layers > 0)] if layers is not None else np.zeros(0)
        # nothing moves (lr 0, e.g. a warmup's first step), or too little to tell an update of 0 from rounding
        still = not len(moving) or np.median(moving) < MOVING
        moved = np.isfinite(ratio) & (ratio > 0)
        trainable = np.asarray(layout.trainable, dtype=bool)
        # a weight norm of 0 (a bias initialised at zero) gives no ratio, and a gradient far smaller than
        # the others relative to its weights (a conv bias before a BatchNorm) may round to an update of 0
        with np.errstate(invalid="ignore", divide="ignore"):
            pull = grad.astype(np.float64) / weights
        usual = np.median(pull[moved & np.isfinite(pull)]) if (moved & np.isfinite(pull)).any() else 0.0
        judged = trainable & (weights > 0) & np.isfinite(pull) & (pull >= TINY * usual) & (grad > 0)
        held = record.vector(HELD, PARAM)
        # not in any optimizer that stepped the model (one did: the update was measured), known whatever its
        # weights (a LoRA B matrix starts at 0) and whether or not the rest moves: a parameter with a gradient
        # has its weights' norm measured, so a ratio of NaN is an update that was not
        # (weights that hold NaN/Inf give a ratio of NaN too, measured or not: nonfinite's finding, not this one's)
        unheld = (np.isnan(ratio) & np.isfinite(weights)) if held is None else held == 0
        left_out = trainable & np.isfinite(grad) & (grad > 0) & unheld
        if len(layout.eps) == len(ratio):  # low precision rounds small updates to 0: not a learning rate of 0
            judged &= np.asarray(layout.eps) <= FINE
        zero = judged & ~moved & (ratio == 0)
        # a step where nothing moves tells nothing about updates of 0: their counts stay as they were
        self._runs = np.where(left_out | zero, self._runs + 1, np.where(still & ~unheld, self._runs, 0))
        out = []
        due = np.flatnonzero(left_out & (self._runs == self.patience))
        if len(due):
            # the optimizers stepping the model hold only frozen parameters: built before they were frozen
            frozen_only = held is None and not (np.isfinite(ratio) & trainable).any()
            out.append(self._report(record, due, False, frozen_only=frozen_only))
        # weights a too-high learning rate blew up round their updates to exactly 0: not judged then
        if not still and not self.causes.named(LR_HIGH, record.step):
            due = np.flatnonzero(zero & (self._runs == self.patience))
            largest = record.vector("grad_max", PARAM)
            squared = np.zeros(len(due), dtype=bool)
            if largest is not None and len(due) and len(layout.eps) == len(ratio):
                squared = (largest[due] > SQUARES) & (np.asarray(layout.eps)[due] > WIDE)
            if squared.any():  # not a learning rate of 0: the optimizer's squares of them overflowed
                out.append(self._report(record, due[squared], True, largest=float(np.max(largest[due[squared]]))))
            if (~squared).any():
                out.append(self._report(record, due[~squared], True))
        return out

    def _report(self, record: StepRecord, idx: np.ndarray, zero: bool, frozen_only: bool = False,
                largest: float | None = None) -> Finding:
        layout = record.layout
        names = [layout.params[i] for i in idx]
        numel = sum(layout.param_numel[i] for i in idx)
        layer = layout.owner(int(idx[0]))
        shown = ", ".join(_layer(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = f"{shown} ({plural(numel, 'element')})"
        verb = "gets" if len(names) == 1 else "get"
        if largest is not None:
            message = (f"{what} {verb} gradients but never change{'s' if len(names) == 1 else ''} (an update of "
                       f"exactly 0 at step {record.step}): gradient elements reach {largest:.3g}, beyond "
                       f"{SQUARES:.2g}, whose squares overflow float32: Adam's second moment turns inf and its "
                       "update 0.")
        elif zero:
            message = (f"{what} {verb} gradients but never change{'s' if len(names) == 1 else ''} (an update of "
                       f"exactly 0 on {plural(self.patience, 'sampled step')} up to step {record.step}) while the "
                       "rest of the model learns: their param group's learning rate is 0.")
        else:
            message = (f"{what} {verb} gradients but no optimizer updates {'it' if len(names) == 1 else 'them'} "
                       f"(not in any param group of the optimizers stepping the model, step {record.step}): "
                       f"{'it never learns' if len(names) == 1 else 'they never learn'}.")
            if frozen_only:
                message = message[:-1] + ("; the optimizers hold only parameters that require no gradient: one built "
                                          "before the model was wrapped or frozen (peft.get_peft_model, "
                                          "requires_grad_(False)) trains nothing.")
        layers = sorted({layout.owner(int(i)) for i in idx}, key=layout.layers.index)
        hint = HINT_SQUARES if largest is not None else HINT_ZERO if zero else HINT_FROZEN if frozen_only else HINT_HELD
        reason = "squares_overflow" if largest is not None else "zero_update" if zero else "not_in_optimizer"
        data = {"parameters": names, "layers": layers, "reason": reason, "hint": hint}
        if largest is not None:
            data["largest"] = largest
        # no trainable parameter is in an optimizer (the run trains nothing at all), or gradients whose squares
        # overflow stop Adam from training them: errors
        severity = "error" if frozen_only or largest is not None else "warning"
        return self.finding(record, severity, layer, message, value=float(len(names)), data=data)
