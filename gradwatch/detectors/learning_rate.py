"""Detector ``learning_rate``: a learning rate far too high or far too low, judged from the first sampled step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector, weighted_median
from gradwatch.detectors.causes import EXPLOSION, LEVEL_LOSSES, LR_HIGH, LR_LOW, QUIET_STEPS, RAISED
from gradwatch.detectors.gates import GATE
from gradwatch.store.findings import Finding
from gradwatch.store.records import CLOSURE_EVALUATIONS, PARAM, StepRecord
from gradwatch.wording import layer as layer_named

HINT_HIGH = (
    "lower the learning rate (by 10x to start with) or add a warmup; with Adam-type optimizers the first "
    "steps move every weight by about lr, so lr must be well below the weights' typical size "
    "(0.02 in a GPT-style initialisation)"
)
HINT_LOST = (
    "lower the learning rate (by 10x to start with, or back to the usual range: 1e-5 to 1e-4 to fine-tune a "
    "pretrained transformer with AdamW) and restart from the weights of before the learning rate was named: "
    "these are wrecked"
)
#: the loss's level at least this many times its first values, after a too-high learning rate was named: diverged
DIVERGED = 2.0
#: the median layer's gradient this small a share of its first judged value: training converged (its updates are
#: small because its gradients are, not because of the learning rate)
CONVERGED = 1e-2
#: the first steps of a run, whose updates say little of the learning rate for ``stall_median``: Adam-type optimizers
#: move every weight by about lr on them, whatever the gradients (bias correction), and the run has learned nothing yet
TRANSIENT = 5
HINT_LOW = (
    "raise the learning rate (check its units and the scheduler: a warmup that never ends, a "
    "lambda that multiplies by a tiny factor, or lr meant for a loss summed instead of averaged)"
)


@dataclass
class LearningRate(Detector):
    """The learning rate judged by what its updates do to the weights, with scale-free priors that
    hold for any model (no history, so nothing to warm up: the first sampled step is judged).

    Too high, on a sampled step: the update-to-weight ratio (||delta w|| / ||w||) of the layers
    holding half of the model's parameters is at least ``high_median`` (the median layer, each
    counted by its number of parameters: a small output layer that rescales itself on the
    first steps does not count for much) and the largest one is at least ``high`` (healthy runs:
    about 1e-3, a few 1e-2 in the first Adam steps without warmup); or the weights grow
    geometrically: the model's parameter norm grew at least ``growth`` times per 10 steps since
    the previous sampled step (at most ``growth`` times between two sampled steps fewer than 10
    steps apart). Either is the learning rate's on the first step judged, when it lasts (the
    previous sampled step or interval was too large too) or when the learning rate was raised
    since the previous sampled step. A learning rate raised ``RAISED`` (10) times or more since the
    previous sampled step is too high at a lower bar: the median layer's ratio at least
    ``high_raised`` and ten times the previous sampled step's (the updates grew with it: a warmup
    from near 0 moves weights by a few 1e-2 at most); a single large update after healthy ones at the same
    learning rate is a gradient's (a corrupted batch: ``exploding``, ``loss_spike``), and so is
    a large update on a step whose gradient exploded. Steps whose closure was evaluated more than
    once (``closure_evaluations``: a line search such as L-BFGS's sized the step) are not judged
    too high.

    Too low: every layer's update is below ``low`` of its weights on ``patience_low`` sampled
    steps in a row (steps where nothing moved, e.g. a warmup starting at lr 0, steps whose
    learning rate was decayed below a tenth of its largest value, and steps whose median layer's
    gradient fell below ``CONVERGED`` (1e-2) of its first judged value -- a converged run whose
    updates are small because its gradients are -- do not count).

    Too high, with a loss that stops falling: on a sampled step, the layers holding half of the model's
    parameters (those that do not move counted too: a model whose bulk is dead does not rewrite its
    weights) move by ``stall_median`` (0.05) or more of their weights (50x the ~1e-3 of healthy runs,
    whatever the optimizer: Adam on a pretrained model at 5e-5 moves them by ~1e-3, at 1e-3 by ~1e-2),
    past the run's first ``TRANSIENT`` (5) steps (Adam's first steps move every weight by about lr
    whatever the gradients: a GPT trained from scratch at 3e-3 without warmup moves them by 0.15x on its
    first step, and learns); layers whose weights started at zero (LoRA's ``lora_B``) have no scale of
    their own and do not count. Large updates alone are not a fault (a small model trained from scratch
    moves fast and learns); with them, within ``3 x confirm`` steps, the loss's level (the median of its
    last 5 values, every step's loss counted) not below its starting level (the lowest of its first 3),
    ``confirm`` steps or more into the run, is: the weights are being rewritten and nothing is learned
    (a fine-tuned classifier collapsed to one class sits at ln 2).

    A learning rate named too high (by this detector or by ``loss_spike``'s divergence) is an
    error once the run shows what it did, ``confirm`` steps or more after it was named: the loss's
    level ``DIVERGED`` (2) times its starting level or more (diverged), or not below it on two
    sampled steps ``confirm`` steps apart (never learned); once per run. A loss that was ever zero
    or negative has no scale: not judged by the loss.

    A learning rate already named too high (by this detector or by ``loss_spike``'s divergence)
    is not named again for 100 steps.

    Attributes:
        high: the largest layer's update ratio, at least, for a too-high learning rate.
        high_median: the median layer's update ratio (weighted by parameters), at least, for a too-high one.
        high_raised: the same, at least, right after the learning rate was raised 10x or more.
        growth: parameter-norm growth per 10 steps that is geometric (too-high learning rate).
        low: every layer's update ratio below this is a too-low learning rate.
        patience_low: consecutive sampled steps for a too-low learning rate.
        stall_median: the median layer's update ratio, at least, that with a loss not falling is too high.
        confirm: steps the loss is given to show what a too-high learning rate did.
    """

    kind = "learning_rate"
    late = True
    bounds = {"high": Bound(0, open_low=True), "high_median": Bound(0, open_low=True),
              "high_raised": Bound(0, open_low=True),
              "growth": Bound(1, open_low=True), "low": Bound(0, open_low=True), "patience_low": Bound(1),
              "stall_median": Bound(0, open_low=True), "confirm": Bound(1)}
    high: float = 0.5
    high_median: float = 0.2
    high_raised: float = 0.1
    growth: float = 2.0
    low: float = 1e-5
    patience_low: int = 2
    stall_median: float = 0.05
    confirm: int = 10
    _version: int = field(default=-1, init=False, repr=False)
    _prev: tuple[int, float, np.ndarray] | None = field(default=None, init=False, repr=False)
    _low_run: int = field(default=0, init=False, repr=False)
    _grad0: float = field(default=math.nan, init=False, repr=False)  # the median layer's gradient, first judged
    _top_lr: float = field(default=0.0, init=False, repr=False)
    _judged: int = field(default=0, init=False, repr=False)  # sampled steps whose updates were judged
    _was_high: bool = field(default=False, init=False, repr=False)  # the previous one's updates were too large
    _intervals: int = field(default=0, init=False, repr=False)  # intervals between sampled steps judged
    _grew: bool = field(default=False, init=False, repr=False)  # the previous interval's weights grew too fast
    _prev_lr: float | None = field(default=None, init=False, repr=False)
    _prev_median: float = field(default=0.0, init=False, repr=False)  # the previous judged step's median ratio
    _from_zero: np.ndarray | None = field(default=None, init=False, repr=False)  # layers whose weights started at 0
    #: the latest sampled step whose updates rewrote the weights: (step, median ratio, largest's layer, largest)
    _hot: tuple[int, float, int, float] | None = field(default=None, init=False, repr=False)
    #: the step and layer this detector named the learning rate too high at
    _layer: tuple[int, str | None] | None = field(default=None, init=False, repr=False)
    _lost: bool = field(default=False, init=False, repr=False)  # the run was called lost (an error): once
    _stuck: int | None = field(default=None, init=False, repr=False)  # first check since naming, loss not fallen

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge a sampled step's update ratios and parameter norms."""
        ratio = record.vector("update_ratio")
        weights = record.vector("param_norm")
        bad = record.vector("grad_nonfinite")
        if record.skipped or ratio is None or weights is None or (bad is not None and (bad > 0).any()):
            return []
        layout = record.layout
        if layout.version != self._version:
            self._version, self._prev, self._low_run, self._from_zero = layout.version, None, 0, None
            self._grad0 = math.nan
        if self._from_zero is None:
            self._from_zero = np.asarray(weights == 0)
        lr = record.scalars.get("lr")
        if lr is not None and math.isfinite(lr):
            self._top_lr = max(self._top_lr, lr)
        ratio = ratio.astype(np.float64)
        measured = np.isfinite(ratio) & np.isfinite(weights) & (weights > 0)
        moving = measured & (ratio > 0)
        # a large update is the learning rate's from the start, when it lasts, or when the learning rate
        # was raised; one after healthy ones at the same learning rate is a gradient's (a corrupted batch)
        raised = lr is not None and self._prev_lr is not None and lr > 1.5 * self._prev_lr
        own = record.scalars.get(CLOSURE_EVALUATIONS, 1.0) > 1  # a line search sized the step (L-BFGS)
        out = self._growth(record, weights, raised, own)
        if moving.any():
            out += self._high(record, ratio, moving, lr, raised, own)
            decayed = lr is not None and lr < 0.1 * self._top_lr
            if not decayed:
                out += self._low(record, ratio, moving, lr)
            self._prev_lr = lr
        out += self._stalled(record, ratio, measured & ~self._from_zero)  # layers that do not move count too
        if out and out[0].data.get("direction") == "high":
            self._layer = (record.step, out[0].layer)
        return out[:1] + self._lost_run(record)  # one cause, one finding; then what it did to the run

    def _stalled(self, record: StepRecord, ratio: np.ndarray, measured: np.ndarray) -> list[Finding]:
        """Updates far beyond any healthy run's, with a loss that has stopped falling."""
        if measured.any():
            idx = np.flatnonzero(measured)
            median = weighted_median(ratio[idx], np.asarray(record.layout.layer_numel, dtype=np.float64)[idx])
            if median >= self.stall_median and record.step >= TRANSIENT:
                top = int(idx[np.argmax(ratio[idx])])
                self._hot = (record.step, median, top, float(ratio[top]))
        levels = self.causes.loss_levels()
        hot = self._hot
        if hot is None or levels is None or record.step - hot[0] > 3 * self.confirm or record.step < self.confirm:
            return []
        start, level, _ = levels
        if level < start or self._named(record):
            return []
        self.causes.note(LR_HIGH, record.step)
        at, median, top, largest = hot
        name, type_ = layer_named(record.layout.layers[top]), record.layout.layer_types[top]
        message = (f"learning rate too high for {name} ({type_}): the updates rewrite the weights (half of them move "
                   f"by {median:.2g}x or more per step at step {at}, {name} by {largest:.2g}x; healthy runs: ~1e-3) "
                   f"and the loss has stopped falling: {level:.4g} at step {record.step} (median of the last "
                   f"{LEVEL_LOSSES}), not below where it started ({start:.4g}); lower it (by 10x to start with).")
        data = {"direction": "high", "evidence": "update_ratio_no_progress", "update_ratio": largest,
                "median": median, "at": at, "loss_level": level, "first": start, "lr": record.scalars.get("lr"),
                "cause": "learning_rate", "hint": HINT_HIGH}
        return [self.finding(record, "warning", record.layout.layers[top], message, value=median, data=data)]

    def _lost_run(self, record: StepRecord) -> list[Finding]:
        """An error, once: the learning rate named too high, and the run diverged or never learned since."""
        last, began = self.causes.when(LR_HIGH), self.causes.began(LR_HIGH)
        levels = self.causes.loss_levels()
        if self._lost or last is None or began is None or levels is None \
                or not 0 <= record.step - last <= QUIET_STEPS + self.confirm:
            return []
        named, since = began  # the episode's first finding, and its raise (the weights were sound before it)
        if record.step - named < self.confirm:
            return []
        start, level, _ = levels
        if level < start:
            self._stuck = None
            return []
        diverged = level >= DIVERGED * start
        self._stuck = record.step if self._stuck is None else self._stuck
        if not diverged and record.step - self._stuck < self.confirm:
            return []
        self._lost = True
        layer = self._layer[1] if self._layer is not None and self._layer[0] == named else None
        by = f" for {layer_named(layer)}" if layer is not None else ""
        if diverged:
            what = (f"the run has diverged since: the loss is {level:.4g} at step {record.step} (median of the last "
                    f"{LEVEL_LOSSES}), {level / start:.3g}x where it started ({start:.4g})")
        else:
            what = (f"the run has not learned since: the loss is {level:.4g} at step {record.step} (median of the last "
                    f"{LEVEL_LOSSES}), not below where it started ({start:.4g}) {record.step - named} steps later")
        raised = f" (raised at step {since})" if since < named else ""
        # too high from the run's first step: no earlier step to go back to, only the weights it started from
        back = f"restart from before step {since}" if since > 0 else "train again from the initial weights"
        message = (f"learning rate too high{by}, named at step {named}{raised}: {what}. The weights are wrecked: "
                   f"lower the learning rate and {back}.")
        data = {"direction": "high", "evidence": "diverged" if diverged else "no_progress", "named_at": named,
                "restart_before": since,
                "loss_level": level, "first": start, "lr": record.scalars.get("lr"), "cause": "learning_rate",
                "hint": HINT_LOST}
        return [self.finding(record, "error", layer, message, value=level, data=data)]

    def _named(self, record: StepRecord) -> bool:
        return self.causes.named(LR_HIGH, record.step)

    def _high(self, record: StepRecord, ratio: np.ndarray, moving: np.ndarray, lr: float | None,
              raised: bool, own: bool) -> list[Finding]:
        idx = np.flatnonzero(moving)
        median = weighted_median(ratio[idx], np.asarray(record.layout.layer_numel, dtype=np.float64)[idx])
        top = int(idx[np.argmax(ratio[idx])])
        largest = float(ratio[top])
        # raised by hand (or a schedule restart) since the previous sampled step, the updates with it
        jumped = (lr is not None and self._prev_lr is not None and lr >= RAISED * self._prev_lr > 0
                  and median >= max(self.high_raised, RAISED * self._prev_median))
        high = (median >= self.high_median and largest >= self.high) or jumped
        due = self._judged == 0 or self._was_high or raised
        self._judged, self._was_high, self._prev_median = self._judged + 1, high, median
        if not high or not due or own or self._named(record):
            return []
        if self.causes.named(EXPLOSION, record.step, within=0):
            return []  # the gradient exploded on this step: its large update is the explosion's consequence
        self.causes.note(LR_HIGH, record.step)
        name, type_ = layer_named(record.layout.layers[top]), record.layout.layer_types[top]
        since = ""
        if jumped and lr is not None and self._prev_lr is not None:
            since = (f" after it was raised {lr / self._prev_lr:.3g}x ({self._prev_lr:.3g} -> {lr:.3g}) since the "
                     "previous sampled step")
        message = (f"learning rate too high for {name} ({type_}){since}: update is {largest:.2g}x the weights at step "
                   f"{record.step} (half the weights move by {median:.2g}x or more; healthy runs: ~1e-3); lower "
                   "it or add warmup.")
        data = {"direction": "high", "evidence": "update_ratio", "update_ratio": largest, "median": median,
                "lr": lr, "cause": "learning_rate", "hint": HINT_HIGH}
        return [self.finding(record, "warning", record.layout.layers[top], message, value=largest, data=data)]

    def _growth(self, record: StepRecord, weights: np.ndarray, raised: bool, own: bool) -> list[Finding]:
        """Parameter norms growing geometrically since the previous sampled step."""
        params = record.vector("param_norm", PARAM)
        if params is None:
            return []
        finite = params[np.isfinite(params)].astype(np.float64)
        total = float(np.sqrt(np.sum(finite * finite))) if len(finite) else math.nan
        prev, layers = self._prev, weights.astype(np.float64)
        self._prev = (record.step, total, layers) if math.isfinite(total) and total > 0 else None
        if prev is None or self._prev is None or record.step <= prev[0]:
            return []
        steps, factor = record.step - prev[0], total / prev[1]
        grew = factor >= 1.25 and factor ** (10.0 / max(steps, 10)) >= self.growth  # no faster than x per 10 steps
        due = self._intervals == 0 or self._grew or raised
        self._intervals, self._grew = self._intervals + 1, grew
        if not grew or not due or own or self._named(record):
            return []
        if self.causes.named(EXPLOSION, record.step, within=steps - 1):
            return []  # an explosion since the previous sampled step made the weights jump
        with np.errstate(invalid="ignore", divide="ignore"):
            growths = np.where((prev[2] > 0) & np.isfinite(prev[2]) & np.isfinite(layers), layers / prev[2], -np.inf)
            # a layer whose weights were near zero (a layer scale at 1e-6, a zero-initialised gate) grows by any
            # factor as it learns: the layer named is the one of ordinary weights that grew most, where one did
            numel = np.maximum(np.asarray(record.layout.layer_numel, dtype=np.float64), 1.0)
            ordinary = prev[2] / np.sqrt(numel) > GATE
        top = int(np.argmax(np.where(ordinary, growths, -np.inf) if np.isfinite(growths[ordinary]).any() else growths))
        self.causes.note(LR_HIGH, record.step)
        name, type_ = layer_named(record.layout.layers[top]), record.layout.layer_types[top]
        message = (f"learning rate too high for {name} ({type_}): its weights grew {growths[top]:.3g}x in {steps} "
                   f"steps up to step {record.step} (the whole model's {factor:.3g}x; healthy runs change by a "
                   "few %); lower it or add warmup.")
        data = {"direction": "high", "evidence": "weight_growth", "growth": factor, "layer_growth": float(growths[top]),
                "steps": steps, "lr": record.scalars.get("lr"), "cause": "learning_rate", "hint": HINT_HIGH}
        return [self.finding(record, "warning", record.layout.layers[top], message, value=factor, data=data)]

    def _low(self, record: StepRecord, ratio: np.ndarray, moving: np.ndarray, lr: float | None) -> list[Finding]:
        largest = float(np.max(ratio[moving]))
        grads = record.vector("grad_norm")
        grad = float(np.median(grads[moving])) if grads is not None else math.nan
        if math.isnan(self._grad0):
            self._grad0 = grad
        converged = grad < CONVERGED * self._grad0  # a converged classifier's updates are ~1e-6 of its weights
        self._low_run = self._low_run + 1 if largest < self.low and not converged else 0
        if self._low_run != self.patience_low:
            return []
        self.causes.note(LR_LOW, record.step)
        median = float(np.median(ratio[moving]))
        at = f" (lr {lr:.3g})" if lr is not None else ""
        message = (f"learning rate too low{at}: the largest update is {largest:.2g}x its layer's weights (median "
                   f"layer {median:.2g}x; healthy runs: ~1e-3) on {self.patience_low} sampled steps in a row up to "
                   f"step {record.step}: training barely moves; raise it.")
        data = {"direction": "low", "evidence": "update_ratio", "update_ratio": largest, "median": median, "lr": lr,
                "cause": "learning_rate", "hint": HINT_LOW}
        return [self.finding(record, "warning", None, message, value=largest, data=data)]
