"""Record stage, the steps recorded without measurement: one an integration leaves out, one whose
gradients a GradScaler dropped (with the origin of a forward pass that went non-finite), and the
first iteration of a loop that updates the parameters by hand.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.step import observed as obs
from gradwatch.step import stats
from gradwatch.step.openstep import Open
from gradwatch.step.recording import Recording
from gradwatch.store.records import AMP_SCALE, StepRecord

if TYPE_CHECKING:  # the settings are built by the public face (gradwatch.options)
    pass

log = logging.getLogger("gradwatch")



class Unmeasured(Recording):
    """The branches of a step's story that record it without measuring its gradients
    (:class:`gradwatch.step.lifecycle.Lifecycle` takes them).
    """

    def _left_out(self, step: int, opt: torch.optim.Optimizer | None) -> Open:
        """A step an integration leaves out (``Watcher.leave_out``): not measured nor judged, not applied."""
        self.leave_out = False
        self.it.probe.take_activations()
        observed, self.it.observed = self.it.observed, {}
        lr = opt.param_groups[0].get("lr") if opt is not None else None
        if "lr" not in observed and isinstance(lr, (numbers.Real, torch.Tensor)):
            observed["lr"] = [lr]
        record = self.unmeasured(step, observed)
        if not self.sampled(self.step):
            self.it.probe.detach_activations()
        self.latest = record.scalars
        return Open(record, skip=True)

    def unmeasured(self, step: int, observed: obs.Observed, *, scaler: Any = None) -> StepRecord:
        """The record of a step whose gradients are not measured: its observed scalars only (and
        the loss scale of ``scaler``, read with them, as ``amp_scale``).
        """
        obs_parts = obs.device_parts(observed)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        scale_parts = [scale] if isinstance(scale, torch.Tensor) else []
        host = stats.to_host([*obs_parts, *scale_parts, *self._pending_parts()])
        scalars = obs.scalars(observed, host[: len(obs_parts)])
        if scale_parts:
            scalars[AMP_SCALE] = float(host[len(obs_parts)])
        if self.pending is not None:
            self._record_pending(host[len(obs_parts) + len(scale_parts):])
        return StepRecord(step=step, time=time.time(), layout=self.found.layout, scalars=scalars,
                          skipped=True, logged=self.logged(step))

    def dropped(self, observed: obs.Observed, *, ongoing: bool) -> None:
        """An iteration whose gradients were dropped without an optimizer step.

        With a GradScaler, the scaler skipped its update: an overflow of the scaled gradients,
        or a forward pass that went non-finite (then a ``nonfinite`` finding, with the origin
        found by replaying it). With neither a scaler nor an optimizer ever seen stepping the
        model, the loop updates the parameters by hand: from now on each backward pass is
        measured as a step (:meth:`manual_step`).

        Args:
            observed: the iteration's observed values.
            ongoing: a new iteration has begun (its forward is the latest one the tracker holds).
        """
        step = self.step
        self.step += 1
        scalers = self.control.objects()[2]
        if not scalers and not self.optimizers.all():
            self._by_hand(step, observed)
            return
        captures = self.tracker.captures if self.tracker is not None else []
        ongoing = ongoing and self.tracker is not None and bool(captures) and self.tracker.latest is captures[-1]
        mine, latest = (captures[:-1], captures[-1:]) if ongoing else (captures, [])
        record = self.unmeasured(step, observed, scaler=scalers[0] if scalers else None)
        if scalers:
            self.why_dropped(record, mine)
        self._skipped(record)
        if self.tracker is not None:
            self.tracker.captures = latest

    def why_dropped(self, record: StepRecord, captures: list[Any]) -> None:
        """A GradScaler dropped this step: a forward pass that went non-finite gets its origin
        (``record.origin``, phase ``forward``) by replaying it; an overflow in backward does not.
        """
        loss = record.scalars.get("loss")
        if self.tracker is None or (loss is not None and math.isfinite(loss)) or not captures:
            return  # a finite loss: the scaled gradients overflowed in backward
        held, self.tracker.captures = self.tracker.captures, captures
        self.it.probe.paused = True
        try:
            origin = self.tracker.find(loss is None or math.isfinite(loss))
        finally:
            self.it.probe.paused = False
            self.tracker.captures = held
        if origin is not None and origin.get("phase") == "forward":
            record.origin = origin

    def _by_hand(self, step: int, observed: obs.Observed) -> None:
        """The first iteration of a loop that updates the parameters by hand (no optimizer step)."""
        self.manual = True
        self.sampled_also.add(step + 1)  # its first measured update: the update ratio at once, not steps later
        record = self.unmeasured(step, observed)
        record.skipped = False  # its update was applied, by hand; only its gradients were not measured
        log.info("gradwatch: no optimizer.step() seen on this model and no GradScaler: the loop updates the "
                 "parameters by hand, so each backward pass is measured as a step from step %d on", step + 1)
        self.writer.submit_meta(step_moment="end of backward (parameters updated by hand, no optimizer.step())")
        self._judged_aside(record, skipped=False)

    def _skipped(self, record: StepRecord) -> None:
        """Judge and record a step whose update a GradScaler dropped (findings act at the next step)."""
        self._judged_aside(record, skipped=True)

    def _judged_aside(self, record: StepRecord, *, skipped: bool) -> None:
        """Judge and record an unmeasured step outside an optimizer step: its findings act at the next step
        (``skipped``: its update was dropped, see :meth:`~gradwatch.judging.judge.Judge.defer`).
        """
        if self.tracker is not None:
            self.tracker.clear()
        self.latest = record.scalars
        findings = self.judge.check(record)
        self.submit(record)
        if findings:
            self.judge.defer(findings, skipped=skipped)
        if not self.sampled(self.step):
            self.it.probe.detach_activations()
