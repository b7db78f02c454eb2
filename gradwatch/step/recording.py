"""Record stage: how a measured step ends — closed and written (sampled steps wait a step for their
update norms); the steps recorded without measurement are :mod:`gradwatch.step.unmeasured`'s.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradwatch.judging.judge import Judge
from gradwatch.step import stats
from gradwatch.step.control import LoopControl
from gradwatch.step.iteration import Iteration
from gradwatch.step.layout import Discovered, retrained
from gradwatch.step.measure import Measure
from gradwatch.step.openstep import Open
from gradwatch.step.optimizers import Optimizers
from gradwatch.step.origin import Tracker
from gradwatch.step.relayout import Changes, rediscovered
from gradwatch.step.snapshots import Snapshots
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.store.thread import Writer
from gradwatch.watching.guard import Guard, guarded

if TYPE_CHECKING:  # the settings are built by the public face (gradwatch.options)
    from gradwatch.options import Options

log = logging.getLogger("gradwatch")


class Recording:
    """The state of a watched model's steps, and how each one ends; the story of a step that
    uses it is :class:`gradwatch.step.lifecycle.Lifecycle`.
    """

    options: Options
    judge: Judge
    control: LoopControl
    writer: Writer
    tracker: Tracker | None
    group: Any
    snapshots: Snapshots | None
    guard: Guard
    step: int
    closed: bool
    found: Discovered
    measure: Measure
    optimizers: Optimizers
    it: Iteration
    #: registrations into the model since the last look (:mod:`gradwatch.step.relayout`)
    changes: Changes
    _model: weakref.ref[torch.nn.Module]
    #: the step between its optimizer pre-hook and the start of the next iteration
    open: Open | None
    #: a closed sampled step waiting for its update norms (read with the next step's host read)
    pending: Open | None
    #: steps sampled off the schedule (a hand-written loop's first measured step)
    sampled_also: set[int]
    #: a step has closed: which optimizers step together is known (see :meth:`settle`)
    one_closed: bool
    #: the step being judged
    current: StepRecord | None
    latest: dict[str, float]
    leave_out: bool
    #: the loop updates the parameters by hand: each backward pass is a step
    manual: bool

    def sampled(self, step: int) -> bool:
        """Whether ``step`` takes the costlier statistics (update ratios, activations)."""
        return step % self.options.sample_period == 0 or step in self.sampled_also

    def logged(self, step: int) -> bool:
        """Whether ``step``'s full per-layer rows are written."""
        return step % self.options.log_every == 0

    def has_open_step(self) -> bool:
        """Whether a step is open (between its optimizer step and the next forward)."""
        return self.open is not None

    def step_post(self, opt: torch.optim.Optimizer) -> None:
        """Optimizer step post-hook: give a skipped step's gradients back, or measure the update."""
        step = self.open
        if step is None:
            return
        step.stepped.add(id(opt))
        if step.skip:
            self.control.give_back(opt)
            return
        entry = self.optimizers.entry(opt)
        if entry is None or not step.before:
            return
        idx, parts = self.measure.update_norms(step.before, entry.indices)
        step.update_idx += idx
        step.update_parts += parts

    def close_step(self) -> None:
        """Close the open step: record it now, or with its update norms at the next host read.

        The step stays open until it is handed on (to the writer, or as the pending step): an exception
        raised in between (a signal handler's ``sys.exit``) leaves it for :meth:`finish` to record, never
        lost (a record handed to the writer twice is written once).
        """
        step = self.open
        assert step is not None
        self.one_closed = True
        before, step.before = step.before, {}
        if self.manual and before and not step.skip:  # updated by hand since the step's moment
            trainable = [i for i, p in enumerate(self.found.params) if p.requires_grad]
            idx, parts = self.measure.update_norms(before, trainable)
            step.update_idx, step.update_parts = step.update_idx + idx, step.update_parts + parts
        if step.update_parts or step.late:
            if self.pending is not None and self.pending is not step:  # never dropped (an interrupted read)
                self._record_pending_now()
            self.pending = step  # its update norms or late values come with the next host read
        else:
            self.submit(step.record)
        self.open = None

    @guarded("flush")
    def settle(self) -> None:
        """Record the step every optimizer has finished, with its update norms (for a flush: on
        disk is everything trained so far, not all but the last step).

        The step stays open while an optimizer that stepped before has not stepped in it yet
        (two optimizers: a flush between their steps), on the first step (which optimizers step
        together is known once a step has ended), and in a loop that updates by hand (the update
        may still be to come). The update norms of a sampled step cost one host read here; in a
        distributed run the next step's read carries them (FSDP shards' are combined there).
        """
        if not self.it.probe.in_watching_thread():  # a reader's thread: the training thread owns the step
            return
        step = self.open
        if step is not None and not self.manual and self.one_closed and step.stepped >= step.optimizers \
                and {id(opt) for opt in self.optimizers.all()} <= step.optimizers:
            self.close_step()
        if self.open is None and self.pending is not None and self.group is None:
            self._record_pending_now()

    def _record_pending_now(self) -> None:
        """Complete the pending sampled step with a host read of its own (no next step will carry it)."""
        assert self.pending is not None
        self._record_pending(stats.to_host(self._pending_parts()))

    def _pending_parts(self) -> list[torch.Tensor]:
        """What the pending step reads apart: its update norms (none for FSDP shards': a step's read
        combines them), then its late values.
        """
        if self.pending is None:
            return []
        sharded = self.group is not None and self.measure.sharded
        return [*(self.pending.update_parts if not sharded else []), *self.pending.late_parts()]

    def _record_pending(self, host: np.ndarray) -> None:
        """Complete the previous step with its update norms (none in ``host``: see
        :meth:`_pending_parts`) and late values (last in ``host``), judge them, and record it.
        """
        pending = self.pending  # pending until handed to the writer (see :meth:`close_step`)
        assert pending is not None
        nlate = len(pending.late_parts())
        host, late_host = host[:len(host) - nlate], host[len(host) - nlate:]
        late = self._judge_loss(pending, pending.fold(late_host)) if pending.late else []
        if len(host) and pending.update_idx:
            self.measure.update_ratios(pending.record.vectors, pending.update_idx, host)
            late += self.judge.check_late(pending.record)
        if late:
            pending.record.logged = pending.record.detail = True
        self.submit(pending.record)
        self.pending = None
        if late:
            self.judge.defer(late)

    def _judge_loss(self, step: Open, loss: float | None) -> list[Finding]:
        """Judge a loss that reached a measured step after its moment (:mod:`gradwatch.step.openstep`)."""
        measured = "grad_norm" in step.record.scalars  # not a step an integration left out
        return self.judge.check_loss(step.record) if loss is not None and measured else []

    def submit(self, record: StepRecord) -> None:
        """Hand a finished step to the writer thread (and the flight recorder)."""
        self.writer.submit(record)
        self.judge.remember(record)

    # ------------------------------------------------------------ the whole run
    def finish(self) -> None:
        """The run closes: record the open, dropped and pending steps."""
        self.changes.close()
        if self.open is not None:
            self.close_step()
        if self.tracker is not None:
            self.tracker.clear()
        self.it.close()
        if self.pending is not None:
            self._record_pending_now()

    def halt(self) -> None:
        """A rule halts training: the step being judged is recorded in full; nothing stays open."""
        self.open = None
        if self.current is not None:
            self.current.logged = self.current.detail = True
            self.submit(self.current)
            self.current = None

    def abandon(self) -> None:
        """After an internal error: drop what is in flight (it cannot be trusted)."""
        self.open = self.pending = None
        self.it.carry = None

    def follow(self) -> None:
        """Look at the model again if a registration changed it since the last look (cheap otherwise)."""
        if self.changes.dirty:
            self.refresh_layout()

    def refresh_layout(self) -> None:
        """Re-discover the model's layers; a changed layout (:func:`rediscovered`) gets a new version."""
        model = self._model()
        if model is None:
            return
        found = rediscovered(model, self.found)
        self.changes.dirty = False
        if found is None:
            return
        if self.open is not None:
            self.close_step()
        if self.pending is not None:
            self._record_pending_now()
        if found.leaf_modules is not self.found.leaf_modules:  # other leaves: what the old ones collected is dropped
            self.it.probe.detach_activations()
        self.found, self.measure = found, Measure(found)
        self.changes.follow(found)
        self.optimizers.reindex(found.params)
        self.it.relayout(found)
        self.it.probe.attending.renew()  # a swapped block may attend: look again

    def retrain(self, trainable: tuple[bool, ...]) -> None:
        """Only which parameters require grad changed: a new version of the same layout, measured as it was
        (its indices stand: the step being read keeps its vectors).
        """
        self.found = self.measure.found = retrained(self.found, trainable)
        self.it.retrained(self.found)
