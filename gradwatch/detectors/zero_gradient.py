"""Detector ``zero_gradient``: every gradient of the step is exactly zero, so nothing learns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.store.findings import Finding
from gradwatch.store.records import CLIP_COEF, PRECLIP, StepRecord
from gradwatch.wording import plural

HINT = (
    "clip_grad_norm_(..., max_norm=0) zeroes every gradient (0 does not mean 'no clipping': skip the call "
    "instead); otherwise the loss does not depend on the parameters (a .detach(), or a loss multiplied by 0) "
    "or the gradients are zeroed between backward() and optimizer.step()"
)
HINT_ZEROED = (
    "look at what runs between backward() and optimizer.step(): a clip with 0 as its bound "
    "(clip_grad_value_(..., 0), clip_grad_norm_(..., max_norm=0)) zeroes every gradient; skip the call to train "
    "unclipped, or pass a positive bound (a max_norm of 1.0 is common)"
)
HINT_CLIP = (
    "max_norm=0 does not mean 'no clipping': skip the clip_grad_norm_ call to train unclipped, or pass a "
    "positive max_norm (1.0 is common)"
)


@dataclass
class ZeroGradient(Detector):
    """Every layer that has a gradient has an exactly-zero one, on ``patience`` steps in a row,
    while the loss (when observed) is not zero: one finding for the whole model, at severity
    error (nothing is learning), instead of a ``vanishing`` finding per layer.

    When the step carries ``grad_norm_preclip`` (the norm before the loop's own clipping) and it
    is positive, the clip itself zeroed the gradients, and the finding says so.

    Attributes:
        patience: consecutive steps with every gradient exactly zero before it is reported.
    """

    kind = "zero_gradient"
    bounds = {"patience": Bound(1)}
    patience: int = 3
    _run: int = field(default=0, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive steps whose gradients are all exactly zero."""
        norms = record.vector("grad_norm")
        loss = record.scalars.get("loss")
        if record.skipped or norms is None:
            return []
        has = ~np.isnan(norms)
        zero = bool(has.any()) and not (norms[has] != 0).any() and loss != 0
        self._run = self._run + 1 if zero else 0
        if self._run != self.patience:
            return []
        before = record.scalars.get(PRECLIP)
        steps = plural(self.patience, "step")
        if before is not None and before > 0:
            message = (f"clip_grad_norm_ scaled every gradient to zero for {steps} up to step {record.step} (global "
                       f"norm {before:.3g} before clipping, 0 after): max_norm=0 turns training off.")
            hint = HINT_CLIP
        elif record.scalars.get(CLIP_COEF) == 0:
            # non-zero at the end of backward, zero at the step, and no clip_grad_norm_ seen (it gives PRECLIP)
            message = (f"every gradient was non-zero at the end of backward and scaled to zero before the optimizer "
                       f"step, for {steps} up to step {record.step}: something between backward() and the step "
                       "zeroes them, such as clip_grad_value_(..., 0) or clip_grad_norm_(..., max_norm=0) (0 does "
                       "not mean 'no clipping'), and turns training off.")
            hint = HINT_ZEROED
        else:
            message = (f"every gradient is exactly zero for {steps} up to step {record.step}: nothing learns; a "
                       "clip_grad_norm_ with max_norm=0 (0 does not mean 'no clipping') or a loss cut off from the "
                       "parameters.")
            hint = HINT
        data = {"layers": int(has.sum()), "grad_norm_preclip": before, "hint": hint}
        return [self.finding(record, "error", None, message, value=0.0, data=data)]
