"""Detector ``adam_epsilon``: gradients so small beside Adam's ``eps`` that the update shrinks far below lr.

Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradwatch.detectors.base import Bound, Detector, weighted_median
from gradwatch.detectors.following import Following
from gradwatch.store.findings import Finding
from gradwatch.store.records import ADAM_EPS, PARAM, StepRecord
from gradwatch.wording import layer as layer_named

HINT = (
    "use a smaller eps (1e-8, or 1e-10 and below unless the optimizer's state is held in bf16/fp16; Wortsman et al. "
    "found eps down to 1e-15 safe for small models), or rescale the loss so that the gradients are larger (check "
    "that it is not divided by a huge factor: a sum over tokens divided twice, a loss weight of 1e-4)"
)
#: the first steps of a run are not judged: its gradients settle
TRANSIENT = 5
#: the median layer's gradient RMS this small a share of its first judged value: training converged (its gradients
#: are tiny because its loss is), whatever eps does to the update
CONVERGED = 1e-2
#: the loss's level, ``confirm`` steps after the warning, not below this share of its level then: it stopped falling
STALLED = 0.9
#: layers named in a message (all of them in ``data["layers"]``)
NAMED = 3


@dataclass
class AdamEpsilon(Detector):
    """Adam's ``eps`` dominates the update: the gradients' RMS is at the scale of eps or below, so the update
    lr * m / (sqrt(v) + eps), about lr * rms / (rms + eps) per element, is a small share of what the learning rate
    asks for, and the model learns next to nothing (Wortsman et al. 2023).

    Judged on sampled steps from the ``adam_eps`` per-parameter vector: the ``eps`` of the param group of each
    parameter held by an optimizer whose update divides by sqrt(v) + eps -- torch.optim's Adam, AdamW, NAdam,
    RAdam, Adamax, SparseAdam and RMSprop (not ``centered``), and any other whose param groups hold both ``eps``
    and ``betas`` except LAMB-type ones (their trust ratio rescales the update); parameters of other optimizers
    (SGD, Adagrad) are not judged. Per layer (over its parameters such an optimizer holds, with gradients), the
    gradient RMS is sqrt(sum of squared parameter gradient norms / their elements), and the update's share of
    the learning rate rms / (rms + eps). Fires (a warning) when the layers holding at least half of those
    parameters (weighted by parameters; layers whose gradient is exactly 0 count as not shrunk) have a share
    below ``shrink`` on ``patience`` sampled steps in a row, past the run's first 5 steps. Not judged once
    training converged: the median layer's RMS below 1/100 of its first judged value, or the loss's level (the
    median of its last 5) below ``fallen`` times where it started (the lowest of its first 3). Once per run.

    An error (a new finding, once) when the loss follows: ``confirm`` steps or more after the warning, with eps
    still dominating on the latest sampled step, the loss's level not below 0.9x its level at the warning (it has
    stopped falling), or at least 1.5x the lowest since, or NaN/Inf (see :mod:`gradwatch.detectors.following`).

    Attributes:
        shrink: the update's share of the learning rate, rms / (rms + eps), below which a layer's update is shrunk.
        patience: consecutive sampled steps with half the parameters shrunk before it is reported.
        fallen: the loss's level at most this share of its start: training converged, not judged.
        confirm: steps after the warning the loss is given to fall before the finding becomes an error.
    """

    kind = "adam_epsilon"
    bounds = {"shrink": Bound(0, 1, open_low=True, open_high=True), "patience": Bound(1),
              "fallen": Bound(0, 1, open_low=True), "confirm": Bound(1)}
    shrink: float = 0.1
    patience: int = 2
    fallen: float = 0.1
    confirm: int = 20
    _version: int = field(default=-1, init=False, repr=False)
    _rms0: float = field(default=math.nan, init=False, repr=False)  # the median layer's RMS, first judged
    _run: int = field(default=0, init=False, repr=False)  # sampled steps in a row with half the parameters shrunk
    _since: int = field(default=0, init=False, repr=False)  # the first of them
    _warned: dict[str, Any] | None = field(default=None, init=False, repr=False)  # the warning's data and loss level
    _follow: Following = field(default_factory=Following, init=False, repr=False)
    _erred: bool = field(default=False, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge a sampled step's gradients against its Adam eps; escalate once the loss stops falling."""
        out = self._judge(record) if record.sampled and not record.skipped else []
        return out or self._escalate(record)

    def _judge(self, record: StepRecord) -> list[Finding]:
        eps = record.vector(ADAM_EPS, PARAM)
        grads = record.vector("grad_norm", PARAM)
        layout = record.layout
        if eps is None or grads is None or not record.gradients_finite() or len(eps) != len(layout.params) \
                or len(grads) != len(eps):
            return []
        if layout.version != self._version:
            self._version, self._run = layout.version, 0
        numel = np.asarray(layout.param_numel, dtype=np.float64)
        eps, grads = eps.astype(np.float64), grads.astype(np.float64)
        held = np.isfinite(eps) & (eps >= 0) & np.isfinite(grads) & (numel > 0)
        owners = np.asarray(layout.owners, dtype=np.int64).reshape(-1, 2)
        owners = owners[held[owners[:, 1]]]
        if not len(owners):
            self._run = 0
            return []
        lay, par = owners[:, 0], owners[:, 1]
        n_layers = len(layout.layers)
        size = np.bincount(lay, weights=numel[par], minlength=n_layers)
        squares = np.bincount(lay, weights=grads[par] ** 2, minlength=n_layers)
        layer_eps = np.zeros(n_layers)
        np.maximum.at(layer_eps, lay, eps[par])
        idx = np.flatnonzero(size > 0)
        rms = np.sqrt(squares[idx] / size[idx])
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(rms > 0, rms / (rms + layer_eps[idx]), 1.0)
        weights = size[idx]
        moving = rms > 0
        if moving.any():
            median = weighted_median(rms[moving], weights[moving])
            if math.isnan(self._rms0):
                self._rms0 = median
            converged = median < CONVERGED * self._rms0
        else:
            converged = True
        levels = self.causes.loss_levels()
        fell = levels is not None and levels[1] <= self.fallen * levels[0]
        shrunk = moving & (share < self.shrink)
        if record.step < TRANSIENT or converged or fell or weights[shrunk].sum() < 0.5 * weights.sum():
            self._run = 0
            return []
        self._run += 1
        if self._run == 1:
            self._since = record.step
        if self._run < self.patience or self._warned is not None:
            return []
        return [self._warning(record, idx[shrunk], squares, size, layer_eps, levels)]

    def _warning(self, record: StepRecord, layers: np.ndarray, squares: np.ndarray, size: np.ndarray,
                 layer_eps: np.ndarray, levels: tuple[float, float, int] | None) -> Finding:
        layout = record.layout
        layers = layers[np.argsort(-size[layers], kind="stable")]  # the largest first
        top = int(layers[0])
        rms = math.sqrt(float(squares[layers].sum() / size[layers].sum()))
        eps = float(str(np.float32(layer_eps[top])))  # as the param group held it (1e-3, not float32's 0.00100000005)
        share = rms / (rms + eps) if eps > 0 else 1.0
        names = [layer_named(layout.layers[i], layout.layer_types[i]) for i in layers[:NAMED].tolist()]
        if len(layers) > NAMED:
            names.append(f"{len(layers) - NAMED} more")
        which = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        part = size[layers].sum() / max(size[size > 0].sum(), 1.0)
        message = (f"Adam's eps dominates the update of {which} ({part:.0%} of the parameters Adam steps): gradient "
                   f"RMS {rms:.3g} against eps {eps:.3g}, so each update is only {share:.3g} of what the learning rate "
                   f"asks for (rms / (rms + eps)), since step {self._since} ({self._run} sampled steps in a row up to "
                   f"step {record.step}); use a smaller eps (1e-8, or 1e-10 and below) or rescale the loss so that "
                   "the gradients are larger.")
        data = {"layers": [layout.layers[i] for i in layers.tolist()], "grad_rms": rms, "eps": eps, "shrink": share,
                "since": self._since, "count": len(layers), "hint": HINT}
        self._warned = {"step": record.step, "layer": layout.layers[top], "data": data,
                        "level": levels[1] if levels is not None and levels[2] >= record.step - 1 else None}
        self._follow.arm(record.step)
        return self.finding(record, "warning", layout.layers[top], message, value=share, data=data)

    def _escalate(self, record: StepRecord) -> list[Finding]:
        """The error, once: the loss follows (stopped falling, rose, or went NaN/Inf) with eps still dominating."""
        warned = self._warned
        if warned is None or self._erred:
            return []
        follows = self._follow.follows(record, self.causes)
        levels = self.causes.loss_levels()
        if levels is not None and warned["level"] is None and levels[2] >= warned["step"]:
            warned["level"] = levels[1]  # the loss's level at the warning (or its first after it)
        stalled = (levels is not None and warned["level"] is not None and record.step - warned["step"] >= self.confirm
                   and levels[1] >= STALLED * warned["level"])
        if self._run == 0 or (follows is None and not stalled):
            return []
        self._erred = True
        data = dict(warned["data"])
        if follows is not None:
            lowest, now = follows
            what = f"the loss has risen to {now:.4g} (its lowest since was {lowest:.4g})"
            data.update(loss_level=now, loss_lowest=lowest)
        else:
            assert levels is not None
            then, now, steps = warned["level"], levels[1], record.step - warned["step"]
            how = f"down only {1 - now / then:.1%} from" if now < then else "not below"
            what = (f"the loss has stalled: {now:.4g} at step {record.step} (median of the last 5), {how} its "
                    f"{then:.4g} of {steps} steps before")
            data.update(loss_level=levels[1], loss_at_warning=warned["level"])
        data["named_at"] = warned["step"]
        message = (f"Adam's eps dominates the update (gradient RMS {data['grad_rms']:.3g} against eps "
                   f"{data['eps']:.3g}: updates {data['shrink']:.3g} of the learning rate), named at step "
                   f"{warned['step']}, and {what}: the model is not learning; use a smaller eps or rescale the loss.")
        return [self.finding(record, "error", warned["layer"], message, value=data["shrink"], data=data)]
