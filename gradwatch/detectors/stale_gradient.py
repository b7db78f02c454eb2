"""Detector ``stale_gradient``: the gradients are never cleared between steps (no ``zero_grad()``)."""

from __future__ import annotations

from dataclasses import dataclass

from gradwatch.detectors.base import Bound, Detector
from gradwatch.store.findings import Finding
from gradwatch.store.records import GRAD_STALE, StepRecord
from gradwatch.wording import plural

HINT = (
    "call optimizer.zero_grad() (or model.zero_grad()) once per step, before backward() or after "
    "optimizer.step(); to accumulate gradients over micro-batches on purpose, clear them after each "
    "optimizer.step(), not never"
)


@dataclass
class StaleGradient(Detector):
    """The gradients an optimizer step applies still hold those of the previous step, on ``patience``
    steps in a row: nothing clears them between steps (a forgotten ``optimizer.zero_grad()``), so
    backward adds to them and every step applies the sum of all the gradients so far.

    Measured at the start of each step's first backward pass: the gradient of one watched parameter
    is still the tensor, unchanged, that the previous step applied (``grad_stale_steps`` counts the
    steps in a row). Gradient accumulation clears after each step and is not affected.

    Attributes:
        patience: consecutive steps applying uncleared gradients before it is reported.
    """

    kind = "stale_gradient"
    bounds = {"patience": Bound(1)}
    patience: int = 2

    def check(self, record: StepRecord) -> list[Finding]:
        """Report when the run of steps with uncleared gradients reaches ``patience``."""
        run = record.scalars.get(GRAD_STALE, 0.0)
        if record.skipped or run != self.patience:
            return []
        message = (f"the gradients applied at step {record.step} still hold those of the "
                   f"{plural(self.patience, 'step')} before it: nothing clears them between steps (no "
                   "optimizer.zero_grad()), so each step applies the sum of every gradient so far.")
        return [self.finding(record, "warning", None, message, value=float(run), data={"hint": HINT})]
