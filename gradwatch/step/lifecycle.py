"""Step lifecycle: one optimizer step told top to bottom — open, measure, judge, act, record, close."""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradwatch.errors import GradwatchWarning, GroupLeft, RunError, TrainingHalted
from gradwatch.judging.judge import Judge
from gradwatch.step import observed as obs
from gradwatch.step import stats
from gradwatch.step.control import LoopControl
from gradwatch.step.iteration import Iteration
from gradwatch.step.layout import Discovered, unwrap
from gradwatch.step.measure import Measure
from gradwatch.step.openstep import Open
from gradwatch.step.optimizers import Optimizers, closure_at, measured_closure, replace_closure
from gradwatch.step.origin import Tracker
from gradwatch.step.reading import Measured, Reading
from gradwatch.step.relayout import Changes, Looks, Trainable
from gradwatch.step.snapshots import Snapshots, rng_state
from gradwatch.store.findings import Finding
from gradwatch.store.records import AMP_SCALE, CLOSURE_EVALUATIONS, GRAD_STALE, PARAM, StepRecord
from gradwatch.store.thread import Writer
from gradwatch.watching.guard import Guard, guarded

if TYPE_CHECKING:  # the settings are built by the public face (gradwatch.options)
    from gradwatch.options import Options


class Lifecycle(Reading):
    """The steps of one watched model: the optimizer step moment, and the story of each step.

    Args:
        model: the watched model (held weakly).
        found: its discovered layout.
        options, judge, control, writer: the run's settings and stages.
        tracker: non-finite origin tracking, or None.
        group: the process group of distributed training, or None.
        snapshots: known-good snapshots kept for rollback rules, or None.
        guard: the watcher's guard: every hook runs through it (an internal error detaches the watcher).
    """

    def __init__(self, model: nn.Module, found: Discovered, options: Options, *, judge: Judge,
                 control: LoopControl, writer: Writer, tracker: Tracker | None, group: Any,
                 snapshots: Snapshots | None, guard: Guard) -> None:
        self.options, self.judge, self.control, self.writer = options, judge, control, writer
        self.tracker, self.snapshots, self.guard = tracker, snapshots, guard
        self.group = control.group = group  # a rollback is agreed on by every rank
        self.step = 0
        self.closed = False
        self._model = weakref.ref(model)
        self.found, self.measure = found, Measure(found)
        self.optimizers = Optimizers(found.params, grown=self._optimizer_changed,
                                     named=lambda names: writer.submit_meta(optimizers=names))
        self.open = self.pending = None
        self.one_closed = False
        self.sampled_also = set()
        self.looks = Looks(options.sample_period)
        self.changes, self.trainable = Changes(found, guard), Trainable()  # the model changed? (relayout)
        self.current = None
        self.latest = {}
        self.since_snapshot, self.snapshots_failed = 0, False  # failed: one could not be written, no more are taken
        #: set by a framework integration (``Watcher.integrate``)
        self.on_halt: Callable[[TrainingHalted], None] | None = None
        self.before_step: Callable[[], None] | None = None
        self.signalled = False
        self.leave_out = False  # the coming step is left out (a rollback's skip_batches)
        self.manual = False  # the loop updates the parameters by hand (see ``Recording.dropped``)
        # last: the probe's hooks are live from here on
        self.it = Iteration(model, found, options, tracker, self, on_step_pre=self.step_pre,
                            on_step_post=self.step_post, guard=guard, buffers=control.buffers)

    def _optimizer_changed(self) -> None:
        """A new optimizer, or param groups added: look at the model now (the next look by missing
        gradients waits its period).
        """
        self.refresh_layout()
        self.looks.looked(self.step)

    # --------------------------------------------------------- the step moment
    def step_pre(self, opt: torch.optim.Optimizer, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Optimizer step pre-hook: the step, or (``step(closure)``) the closure wrapped to open it."""
        if self.signalled:
            return None
        kwargs = kwargs or {}
        at = closure_at(opt, args, kwargs)
        if at is None:
            self.step_at(opt, False)
            return None
        if self.closed or self.optimizers.entry(opt) is None:
            return None
        # branch: optimizer.step(closure) — the gradients exist only once step() has run the closure
        return replace_closure(args, kwargs, at, measured_closure(
            kwargs[at] if isinstance(at, str) else args[at],
            evaluated=self.guard.hook("closure", lambda loss: self._evaluated(opt, loss)), aside=self._evaluated_again,
            closed=lambda: self.closed))

    def _evaluated(self, opt: torch.optim.Optimizer, loss: Any) -> None:
        """A closure's first evaluation computed the gradients: its loss is observed unless it observed one."""
        if loss is not None and "loss" not in self.it.observed:
            self.it.observed["loss"] = [obs.validated("loss", loss)]
        self.signalled_step(opt, False)
        if self.open is not None:
            self.open.record.scalars[CLOSURE_EVALUATIONS] = 1.0

    def _evaluated_again(self, closure: Any) -> Any:
        """A further evaluation of the step's closure (a line search): counted, run with the hooks aside."""
        if self.open is not None and CLOSURE_EVALUATIONS in self.open.record.scalars:
            self.open.record.scalars[CLOSURE_EVALUATIONS] += 1.0
        return self.it.aside(closure)

    @guarded("gradients_ready")
    def signalled_step(self, opt: torch.optim.Optimizer, scaled: bool) -> None:
        """A framework (or a closure's first evaluation) says the gradients are final."""
        self.step_at(opt, scaled)

    def step_at(self, opt: torch.optim.Optimizer, scaled: bool) -> None:
        """The gradients ``opt`` is about to apply are final: open the step, or join the open one."""
        if not self.closed:
            self.follow()  # a submodule or parameter set since the last look
        entry = None if self.closed else self.optimizers.entry(opt)
        if entry is None:  # another model's optimizer: did it step on a backward pass through this one?
            self.it.served = self.it.served or (self.it.backward is not None and bool(self.optimizers.all()))
            return
        if self.open is not None and id(opt) in self.open.optimizers:
            self.close_step()  # the same optimizer steps again: a new iteration without a forward
        if self.open is None:
            if self.before_step is not None:
                self.before_step()  # a framework observes values, or leaves the step out
            try:
                self.open = self._begin(opt, scaled, entry.indices[0])
            except TrainingHalted as halt:
                if self.on_halt is None:
                    raise
                self.control.withhold(opt)
                self.on_halt(halt)
                return
            if self.open is None:  # a GradScaler overflow: the scaler will not step
                return
        self.open.optimizers.add(id(opt))
        if self.open.skip:  # act: this optimizer applies nothing
            self.control.hold(opt, [self.found.params[i] for i in entry.indices])

    def manual_step(self) -> None:
        """The end of a backward pass in a loop that updates the parameters by hand: the step moment.

        Actions act as in a loop with an optimizer: clip scales the gradients; skip and rollback
        zero them, so that the hand-written update adds nothing; halt raises out of ``backward()``.
        """
        if self.closed or not self.manual:
            return
        if self.open is not None:
            self.close_step()
        self.open = self._begin(None, False)
        if self.open is not None and self.open.skip:
            grads = [p.grad for p in self.found.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def _begin(self, opt: torch.optim.Optimizer | None, scaled: bool, held: int | None = None) -> Open | None:
        """The story of one step, up to the optimizer's update; None when the GradScaler drops it."""
        version = self.found.layout.version                         # the model changed? (gradwatch.step.relayout)
        self.follow()
        cast = self.sampled(self.step) and self.trainable.cast(self.found)
        if self.looks.due(self.measure.missing, self.step) or cast:
            self.refresh_layout()
        held = held if self.found.layout.version == version else None  # else an index of the layout before
        step, now = self._count()                                   # open
        if self.leave_out:                                          # branch: an integration leaves it out
            return self._left_out(step, opt)
        measured = self._measure(step, opt)                         # measure: the step's one host read
        trainable = self.trainable.now(self.found, measured.vectors.get((PARAM, "grad_norm")),
                                       measured.launched.tidx if measured.launched.sampled else None)
        if trainable is not None and any(trainable):                # frozen or unfrozen: a new version
            self.retrain(trainable)
        if scaled and measured.nonfinite:                           # branch: the scaler skips the update
            self._overflowed(step, now, measured)
            return None
        record = StepRecord(step=step, time=now, layout=self.found.layout,
                            scalars={"grad_norm": measured.total, **measured.scalars}, vectors=measured.vectors,
                            logged=self.logged(step) or measured.nonfinite, sampled=measured.launched.sampled,
                            detail=measured.launched.sampled or measured.nonfinite, histograms=measured.histograms)
        if self.it.stale:                                           # the gradients were never cleared
            record.scalars[GRAD_STALE] = float(self.it.stale)
        findings = self._judge(record, measured.nonfinite)          # judge
        self._act(record, findings, measured)                       # act (a halt raises)
        self.it.applied(self.it.sentinel if held is None else held)  # were they cleared by the next backward?
        if self.control.skipping:                                   # branch: skipped or rolled back
            record.skipped = True
            return Open(record, skip=True, counts=measured.counts)
        self.control.healthy()
        if self.snapshots is not None and not self.snapshots_failed and not any(f.severity != "info" for f in findings):
            self._keep_snapshot(record.step)
        return Open(record, before=self.measure.snapshot(measured.launched), counts=measured.counts)  # closes later

    def _overflowed(self, step: int, now: float, measured: Measured) -> None:
        """A step whose unscaled gradients are not finite: the GradScaler skips it (a framework said so)."""
        scale = self._loss_scale()  # the framework's scaler; nan when gradwatch cannot reach it
        scalars = dict(measured.scalars)
        scalars[AMP_SCALE] = float(stats.to_host([scale])[0]) if scale is not None else math.nan  # a rare step
        record = StepRecord(step=step, time=now, layout=self.found.layout, scalars=scalars, skipped=True,
                            logged=self.logged(step))
        self.why_dropped(record, self.tracker.captures if self.tracker is not None else [])
        self._skipped(record)

    def _count(self) -> tuple[int, float]:
        """Open a step: its number and time; the iteration's micro-batches join it."""
        step, now = self.step, time.time()
        self.step += 1
        self.it.stepped()
        return step, now

    def _judge(self, record: StepRecord, nonfinite: bool) -> list[Finding]:
        """What is wrong with the step: the detectors' findings (every rank agreeing), with the
        origin of a non-finite value found by replaying the step.
        """
        self.latest = record.scalars
        loss = record.scalars.get("loss")
        loss_finite = loss is None or math.isfinite(loss)
        if self.tracker is not None:
            if nonfinite or not loss_finite:
                self.it.probe.paused = True
                try:
                    record.origin = self.tracker.find(loss_finite)
                finally:
                    self.it.probe.paused = False
        findings = self.judge.check(record)
        if self.tracker is not None:
            if findings:  # the samples that carry a loss spike or an exploding step, by per-sample replays
                self.it.probe.paused = True
                try:
                    self.tracker.explain(findings)
                finally:
                    self.it.probe.paused = False
            self.tracker.clear()
        if self.group is not None:  # every rank judges the same findings: the same action everywhere
            if self.group.due(record.step):
                findings += self.group.check_replicas(record.step, self.found.params, self.found.layout.param_layers())
            findings = self.group.share(findings)
            if self.group.departed:  # gradwatch failed on some rank: every rank stops watching, now
                raise GroupLeft(self.group.departed, self.group.size)
        return findings

    def _act(self, record: StepRecord, findings: list[Finding], measured: Measured) -> None:
        """The rules' actions on the findings, before the optimizer applies the step (a halt raises)."""
        self.control.begin(record.step, measured.launched.grads, measured.total)
        self.current = record
        try:
            self.judge.step(record, findings, self.control)
        finally:
            self.control.end()
        self.current = None

    def model(self) -> nn.Module:
        """The watched model (the user's module inside any compile/DDP wrapper)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the watched model was garbage-collected")
        return unwrap(model)

    def _keep_snapshot(self, step: int) -> None:
        """Keep a known-good snapshot every ``snapshot_every`` healthy steps (rollback rules only)."""
        assert self.snapshots is not None
        self.since_snapshot += 1
        if self.snapshots.items and self.since_snapshot < self.options.snapshot_every:
            return
        self.since_snapshot = 0
        try:
            self.snapshots.take(step, self.model(), *self.control.objects(), rng_state())
        except (OSError, RunError, RuntimeError) as exc:  # a full disk, an unwritable folder
            self.snapshots_failed = True
            warnings.warn(f"gradwatch could not write a rollback snapshot at step {step} ({exc}); no more snapshots "
                          "are taken in this run: a rollback restores an older one, or skips the step if there is "
                          "none. Training goes on.", GradwatchWarning, stacklevel=2)
