"""Watcher: the public face of one watched model — what a loop and a framework integration call."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradwatch.config import Config
from gradwatch.errors import GradwatchError, GroupLeft, InternalWarning
from gradwatch.integrations.framework import FrameworkAPI
from gradwatch.judging.judge import Judge
from gradwatch.options import Options
from gradwatch.rootcause import loader
from gradwatch.rootcause.skiplist import SkipList
from gradwatch.step import observed, origin
from gradwatch.step.control import LoopControl
from gradwatch.step.layout import discover
from gradwatch.step.lifecycle import Lifecycle
from gradwatch.step.openstep import into
from gradwatch.step.origin import Tracker
from gradwatch.step.snapshots import Snapshots
from gradwatch.store import verdict
from gradwatch.store.thread import WriterDied
from gradwatch.watching import ending, startup
from gradwatch.watching.guard import Guard

log = logging.getLogger("gradwatch")


class Watcher(FrameworkAPI):
    """Watches one model: measures every optimizer step and streams records to the run.

    Created by :func:`gradwatch.watch`; reach it with :func:`gradwatch.watcher`.
    """

    def __init__(self, model: nn.Module, run_dir: Path, options: Options, config: Config | None = None,
                 on_close: Callable[[Watcher], None] | None = None) -> None:
        config = config if config is not None else Config(None, source="none")
        self.run_dir = run_dir
        self.rules = config.rules
        self._status = "finished"
        self._halt: dict[str, Any] | None = None
        #: gradwatch detached itself after an internal failure; every call is now a no-op
        self.detached = False
        self._on_close = on_close
        found = discover(model, version=1)  # a model with nothing to train fails here, before any file
        #: every hook, callback and thread of this watcher runs through it: a failure detaches the watcher
        self.guard = Guard(self._fail)
        out = startup.open_outputs(run_dir, startup.run_meta(model, found, options, config), options, config,
                                   self.guard, found.layout)
        self.options, self.writes, self._writer = out.options, out.writes, out.writer
        found, start = startup.first_step(out, found, options, run_dir)  # a resumed run goes on from its step
        self.judge = Judge(config, self.options, self._writer, out.plugin_actions)
        startup.prime(self.judge, out, run_dir)
        self.control = LoopControl(self)
        #: samples left out of :meth:`batches` (a rule's ``skip_samples``), in the run's ``skip_samples.txt``
        self.skip_list = SkipList(run_dir if self.writes else None)
        self.snapshots: Snapshots | None = None
        if self.judge.rolls_back:
            where = Path(self.options.snapshot_dir) if self.options.snapshot_dir is not None else None
            self.snapshots = Snapshots(self.options.snapshot_keep, where)
        self._steps = Lifecycle(model, found, self.options, judge=self.judge, control=self.control,
                                writer=self._writer, tracker=Tracker(model) if self.options.origin else None,
                                group=out.group, snapshots=self.snapshots, guard=self.guard)
        self._steps.step = start

    @property
    def step(self) -> int:
        """Steps so far (the number of the next step)."""
        return self._steps.step

    @property
    def closed(self) -> bool:
        """Whether the run is closed (after :meth:`close`, a halt or an internal error)."""
        return self._steps.closed

    # ------------------------------------------------------------ public API
    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names in model order."""
        return self._steps.found.layout.layers

    def observe(self, *, sample_ids: Any = None, sample_losses: Any = None, **scalars: Any) -> None:
        """Record extra scalars (``loss=``, ``lr=`` ...) for the step that follows; a loss observed
        after ``optimizer.step()``, before the next forward call, is the step's just taken.

        Values may be Python numbers or one-element tensors (read with a step's single host read,
        never here). Several values of one name for a step are averaged. Once the watcher is
        closed (or detached after an internal failure) values are checked, then dropped.

        ``sample_ids`` (a sequence or 1-D tensor, in batch order) names the samples findings blame
        (and a rule's ``skip_samples`` leaves out); ``sample_losses`` (one per sample) tells a loss
        spike which samples carry it. Both belong to the latest forward pass, or the next.

        Raises:
            ValueError: a name gradwatch measures itself (``grad_norm``), a tensor of more than one
                element, or a number too large for a float.
            TypeError: a value that is neither a number nor a tensor; sample ids that are not a
                sequence; sample losses that are not a tensor.
        """
        values = {name: observed.validated(name, value) for name, value in scalars.items()}
        samples = origin.checked_samples(sample_ids, sample_losses)
        if self.closed:
            return
        if samples and self._steps.tracker is not None:
            self._steps.tracker.note(**samples)
        for name, value in values.items():  # the step that follows, or the one just taken (gradwatch.step.openstep)
            into(self._steps.open, self._steps.it, name, scalars[name]).setdefault(name, []).append(value)

    def flush(self) -> None:
        """Block until every step trained so far is on disk (see ``Recording.settle`` for the latest one)."""
        if not self.closed:
            self._steps.settle()
        try:
            self._writer.flush()
        except WriterDied as exc:
            self.guard.failed("flush", exc)

    def track(self, *objects: Any) -> None:
        """Snapshot and restore these LR schedulers / GradScalers on rollback.

        Schedulers of the model's optimizers and an enabled GradScaler are found automatically;
        this is for objects gradwatch cannot find (e.g. several scalers).
        """
        for obj in objects:
            self.control.track(obj)

    @property
    def pending_skips(self) -> int:
        """Upcoming batches a rollback asked to skip (:meth:`batches` skips them for you)."""
        return self.control.pending_skips

    def batches(self, iterable: Any, *, skip: Any = None) -> Any:
        """Iterate over ``iterable`` (a DataLoader ...), leaving out the batches a rollback skips
        and the samples of the skip list (:attr:`skip_list`).

        A map-style DataLoader's dataset indices are the samples' ids (unless ``observe(sample_ids=...)``
        gives others); ``skip`` adds an earlier run's skip list (its directory or file) or ids.

        Example:
            ``for x, y in gw.watcher(model).batches(loader): ...``
        """
        if skip is not None:
            self.skip_list.load(skip)
        for item, ids in loader.indexed(iterable, self.skip_list):
            if self.control.pending_skips > 0:
                self.control.pending_skips -= 1
                continue
            if ids is not None and self._steps.tracker is not None and not self.closed:
                self._steps.tracker.note(sample_ids=ids, weak=True)
            yield item

    def leave_out_samples(self, ids: list[Any]) -> list[Any]:
        """Add samples to the skip list and its file; returns the new ones."""
        return self.skip_list.extend(ids)

    @property
    def findings(self) -> dict[str, Any]:
        """Counts of findings so far by severity, and the worst severity seen."""
        return self.judge.summary()

    @property
    def latest(self) -> dict[str, float]:
        """The global scalars of the latest step (``grad_norm``, ``loss``, ``lr`` ...), as host numbers.

        Taken from the step's single host read (reading them costs nothing); empty before the
        first step. ``grad_norm`` is missing on a step whose gradients were not measured.
        """
        return dict(self._steps.latest)

    # ---------------------------------------------------- used by the control
    def model(self) -> nn.Module:
        """The watched model (the user's module inside any compile/DDP wrapper)."""
        return self._steps.model()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping this model's parameters."""
        return self._steps.optimizers.all()

    def clip_bound(self) -> float:
        """The adaptive clipping bound: the largest global norm the run's healthy history calls normal."""
        return self.judge.clip_bound()

    def snapshot_restored(self) -> None:
        """A rollback restored a snapshot: count healthy steps towards the next one afresh."""
        self._steps.since_snapshot = 0

    def halted(self, step: int, reason: str) -> None:
        """A rule halts training at ``step``: write everything and close the run as halted."""
        self._halt = {"step": step, "reason": reason}
        self._steps.halt()
        self.close("halted")

    def close(self, status: str | None = None, detail: dict[str, Any] | None = None) -> None:
        """Write what is pending, detach every hook, and close the run as ``status`` (None: finished, or
        terminated after a SIGTERM), ``detail`` in its verdict (idempotent; never raises for a failure of
        gradwatch's own: the run keeps what was written, closed as crashed).
        """
        if self._steps.closed:
            return
        status, detail = (status, detail) if status is not None else ending.outcome({}, at_exit=False)
        self._steps.closed, failed = True, False
        try:
            self._steps.finish()
            self.judge.close()
        except Exception:
            failed = True
            log.exception("gradwatch: internal error while closing %s", self.run_dir)
        finally:
            self._steps.it.probe.detach()
            final = status or ("crashed" if failed else self._status)
            self._writer.close(final)
            self._write_verdict(final, detail if final == status else None)
            if self._on_close is not None:
                self._on_close(self)

    def orphan(self) -> None:
        """In a child forked from the watching process (``os.fork``, multiprocessing's ``fork``, a DataLoader
        worker): this watcher goes quiet there for good. Its hooks are removed (the child trains at full speed),
        nothing is recorded, flushed or closed (the run and its writer thread are the parent's, which goes on
        with them), and it stays reachable, closed (``gw.watcher(model).observe(...)`` does nothing):
        ``gw.watch(model, run=...)`` in the child watches the model anew, into a run of its own.
        """
        if self.detached and self.closed:
            return
        self.detached = True
        self.guard.detach()  # a hook torch still calls (an output's, of a graph made before the fork) does nothing
        self._steps.closed = True
        self._steps.abandon()
        self._steps.changes.close()
        self._steps.it.probe.detach()
        self._writer.orphan()

    def _write_verdict(self, status: str, detail: dict[str, Any] | None = None) -> None:
        if not self.writes:
            return
        summary = self.judge.summary()
        try:
            verdict.write(self.run_dir, {"status": status, "steps": self.step, "worst": summary["worst"],
                                         "findings": summary["counts"], "halted": self._halt,
                                         "rollbacks": self.control.rollbacks, **(detail or {})})
        except GradwatchError as exc:  # the run itself is intact in the store
            log.error("gradwatch: could not write the verdict of %s: %s", self.run_dir, exc)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(*ending.of_block(exc_type, exc))

    def __repr__(self) -> str:
        return f"Watcher(run={str(self.run_dir)!r}, step={self.step}, closed={self.closed})"

    def _fail(self, exc: BaseException, kind: str = "", args: tuple[Any, ...] = ()) -> None:
        """Detach after an internal error (in a hook of ``kind`` called with ``args``), keeping what was
        recorded; training is not touched. The watcher stays reachable (``gw.watcher(model)``), detached.
        """
        if self.detached:
            return
        group = self._steps.group
        if group is not None and not group.departed:  # the other ranks must learn of it in a collective
            from gradwatch.integrations.distributed import moment_missed
            if moment_missed(group, self._steps, self.guard.moments, kind, args):  # they wait in this step's
                group.begin(self._steps.step, self._steps.found.params, self.guard.moments)
            if not group.in_step:
                if not group.leaving:
                    log.error("gradwatch: internal error on rank %d (%r); every rank stops watching at the "
                              "next step", group.rank, exc)
                group.leaving = True  # told at the next step's share; until then the step goes on as usual
                return
            group.leave()  # now: this step's remaining collectives, with nothing of this rank's own
        self.detached = True
        self.guard.detach()
        self._steps.abandon()
        self.close("crashed")
        what = exc if isinstance(exc, GroupLeft) else f"gradwatch stopped watching after an internal error ({exc!r})"
        warnings.warn(f"{what}; training continues unwatched. The run so far is in {str(self.run_dir)!r}.",
                      InternalWarning, stacklevel=3)
