"""Detector ``amp_overflow``: the GradScaler skipped a step, or keeps skipping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradwatch.detectors.base import Bound, Detector
from gradwatch.store.findings import Finding
from gradwatch.store.records import AMP_SCALE, StepRecord

HINT = (
    "occasional skips while the scaler calibrates are normal; a run of them means gradients are "
    "non-finite at any scale: look for a nonfinite finding, or train in bf16"
)


@dataclass
class AmpOverflow(Detector):
    """Steps whose gradients were dropped without an optimizer step (a GradScaler overflow).

    Each skip is ``info`` (repeats are folded into a count); ``warn_after`` skips in a row are a
    warning and ``error_after`` in a row an error: training is not progressing.

    Attributes:
        warn_after: consecutive skipped steps that make a warning.
        error_after: consecutive skipped steps that make an error.
    """

    kind = "amp_overflow"
    bounds = {"warn_after": Bound(1), "error_after": Bound("warn_after")}
    warn_after: int = 20
    error_after: int = 100
    _run: int = field(default=0, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive skipped steps."""
        if not record.skipped or AMP_SCALE not in record.scalars:  # skipped, by a GradScaler
            self._run = 0
            return []
        loss = record.scalars.get("loss")
        if (loss is not None and not math.isfinite(loss)) or (record.origin or {}).get("phase") == "forward":
            self._run += 1  # a NaN/Inf forward pass, not an overflow: the nonfinite finding says so
            return []
        self._run += 1
        n = self._run
        severity = "error" if n >= self.error_after else "warning" if n >= self.warn_after else "info"
        if n == 1:
            message = (f"step {record.step} was skipped by the GradScaler: its scaled gradients "
                       f"overflowed{_scale(record)}.")
        else:
            message = (f"{n} steps in a row skipped by the GradScaler up to step {record.step}{_scale(record)}: "
                       "training is not progressing.")
        if severity != "info" and n not in (self.warn_after, self.error_after):
            return []
        return [self.finding(record, severity, None, message, value=float(n), data={"consecutive": n, "hint": HINT})]


def _scale(record: StepRecord) -> str:
    """`` (loss scale now X)`` when the scale is known."""
    scale = record.scalars.get(AMP_SCALE, math.nan)
    return f" (loss scale now {scale:g})" if math.isfinite(scale) else ""
