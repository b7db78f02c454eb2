"""Detector ``loss_spike``: the observed loss far above its own recent history."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.baseline import Ema
from gradwatch.findings import Finding
from gradwatch.records import StepRecord

HINT = (
    "look at the batch of this step (corrupted samples or labels), lower the learning rate, "
    "or clip gradients; a spike that recurs at the same data position points at the data"
)


@dataclass
class LossSpike(Detector):
    """The loss (observed with ``watcher.observe(loss=...)``) against an EMA of its history.

    Flagged when ``loss - mean > max(z * std, ratio * |mean|)`` once ``warmup`` losses have
    entered the baseline. Flagged and non-finite losses never enter it. A run of flagged steps
    is one spike, reported at its first step; a loss that stays high for ``adapt_after``
    steps is a new level, and the baseline follows it from then on.

    Attributes:
        z: z-score beyond which a loss is flagged.
        ratio: a flagged loss also exceeds the mean by at least this fraction of it.
        beta: EMA decay of the baseline.
        warmup: losses in the baseline before it judges.
        adapt_after: consecutive flagged steps after which the baseline accepts the new level.
    """

    kind = "loss_spike"
    bounds = {"beta": Bound(0, 1, open_high=True), "warmup": Bound(1)}
    z: float = 6.0
    ratio: float = 1.0
    beta: float = 0.98
    warmup: int = 20
    adapt_after: int = 20
    _ema: Ema = field(init=False, repr=False)
    _run: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._ema = Ema(self.beta)

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the step's loss, then fold it in if it was not flagged."""
        loss = record.scalars.get("loss")
        if loss is None or not math.isfinite(loss):
            return []
        ema = self._ema
        mean, std = ema.mean, ema.std()
        flagged = ema.ready(self.warmup) and loss - mean > max(self.z * std, self.ratio * abs(mean))
        self._run = self._run + 1 if flagged else 0
        if not flagged or self._run > self.adapt_after:
            ema.update(loss)
        if self._run != 1:
            return []
        zscore = (loss - mean) / max(std, 1e-12)
        message = f"loss {loss:.4g} at step {record.step} is {zscore:.3g} std above its recent mean {mean:.4g}."
        return [self.finding(record, "warning", None, message, value=loss,
                             data={"loss": loss, "mean": mean, "std": std, "hint": HINT})]
