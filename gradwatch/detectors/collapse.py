"""A collapse of the whole model: every layer's gradient fell far below its first steps' while the loss stalled.

Judged by :class:`~gradwatch.detectors.vanishing.Vanishing` (kind ``vanishing``, its ``collapse``
setting): per-layer vanishing compares a layer with the others, so a model whose layers all fall
together, the median with them, is out of its sight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradwatch.detectors.base import median as _median
from gradwatch.detectors.causes import LR_HIGH, Causes
from gradwatch.store.records import StepRecord
from gradwatch.wording import layer as _layer

#: the steps whose median layer RMS makes a run's early gradient size (the median of them)
EARLY_STEPS = 5
#: sampled steps in a row on which the model's gradients must be collapsed before it is reported
COLLAPSED_SAMPLES = 3
#: a layer whose RMS is at least this fraction of the early median still learns (named in a collapse)
ALIVE = 0.1
#: a loss whose level is at least this fraction of where it started has not fallen much: a collapse then
#: is not convergence (a classifier that converges has its gradients fall 10,000x, with its loss)
STALLED = 0.5
HINT_COLLAPSE = (
    "lower the learning rate (by 10x to start with) or lengthen its warmup: a collapse after the first steps is "
    "most often updates too large for the model (saturated softmax/attention, units pushed dead, normalisation "
    "layers that absorb everything); then check the initialisation"
)


@dataclass
class Collapse:
    """The state of one run's collapse judgement: its early gradient size, and how long it has collapsed."""

    early: list[float] = field(default_factory=list)  # the median layer RMS of the first steps
    runs: int = 0  # sampled steps in a row collapsed
    told: bool = False  # said (once per run)
    top_lr: float = 0.0  # the highest learning rate seen

    def check(self, record: StepRecord, rms: np.ndarray, has: np.ndarray, bound: float, *, dead: bool,
              causes: Causes) -> tuple[str, float, dict[str, Any]] | None:
        """The whole model's gradients collapsed while its loss stalled: said once.

        Returns the finding's message, value and data when it is due (once), else None.

        The median layer's RMS of the first ``EARLY_STEPS`` steps is the run's early gradient size.
        On ``COLLAPSED_SAMPLES`` sampled steps in a row, the median layer's RMS is below ``bound``
        times it, and the loss's level (the median of its latest values) is still at least
        ``STALLED`` of where it started: the layers pass next to no gradient back while there is
        plenty left to learn (a seq2seq transformer at 10x its learning rate: its loss stops at the
        unigram level, its median gradient falls 10,000x). A converged model's gradients fall as
        far, with its loss; a loss without a scale (ever zero or negative) or not observed is not
        judged, nor is a collapse within 100 steps of a learning rate named too high (its doing,
        already said) or while a leaf is dead (``dead``: ``dead_units``').
        """
        lr = record.scalars.get("lr")
        if lr is not None and np.isfinite(lr):
            self.top_lr = max(self.top_lr, float(lr))
        alive = has & (rms > 0)
        if self.told or not alive.any():
            return None
        if len(self.early) < EARLY_STEPS:
            self.early.append(_median(rms[alive]))
            return None
        if not record.sampled:
            return None
        early, median = _median(np.asarray(self.early)), _median(rms[alive])
        levels = causes.loss_levels()
        stalled = levels is not None and levels[1] >= STALLED * levels[0]
        if not (median < bound * early and stalled) or dead or causes.named(LR_HIGH, record.step):
            self.runs = 0
            return None
        self.runs += 1
        if self.runs < COLLAPSED_SAMPLES:
            return None
        assert levels is not None
        self.told = True
        layout = record.layout
        learning = np.flatnonzero(alive & (rms >= ALIVE * early)).tolist()
        start, level, _ = levels
        still = ""
        if learning:
            named = ", ".join(_layer(layout.layers[i], layout.layer_types[i]) for i in learning[:3])
            still = (f" Only {named}{' and more' if len(learning) > 3 else ''} still "
                     f"{'gets' if len(learning) == 1 else 'get'} a gradient of their early size.")
        top = f" (it reached {self.top_lr:.3g})" if self.top_lr > 0 else ""
        message = (f"the gradients of the whole model collapsed: the median layer's RMS is {median:.2g} at step "
                   f"{record.step}, {early / median:,.0f}x below its first steps' {early:.2g}, while the loss has "
                   f"stalled at {level:.4g} (it started at {start:.4g}): the model has stopped learning.{still} "
                   f"Most often the learning rate is too high for it{top}: lower it or lengthen its warmup.")
        data = {"evidence": "collapse", "median_rms": median, "early_rms": early, "loss_level": level,
                "first": start, "learning": [layout.layers[i] for i in learning][:20], "lr_peak": self.top_lr or None,
                "hint": HINT_COLLAPSE}
        return message, float(median / early), data
