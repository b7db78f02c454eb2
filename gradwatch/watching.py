"""Watcher: the per-model step lifecycle — hooks in, one host read per step, records out."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradwatch import stats, verdict
from gradwatch.config import Config
from gradwatch.control import LoopControl
from gradwatch.errors import GradwatchError, InternalWarning, TrainingHalted
from gradwatch.judge import Judge, build_plugin_actions
from gradwatch.layout import discover, unwrap
from gradwatch.measure import Measure
from gradwatch.options import Options
from gradwatch.origin import Tracker
from gradwatch.probe import Probe
from gradwatch.records import StepRecord
from gradwatch.sinks import plugin_sinks
from gradwatch.sinks.store import Store
from gradwatch.snapshots import Snapshots, rng_state
from gradwatch.store.writer import create_store, default_meta
from gradwatch.writer import Writer

log = logging.getLogger("gradwatch")


def _distributed_group(options: Options) -> Any:
    """The process group this process trains in with others, as gradwatch uses it; None if alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from gradwatch.integrations.distributed import Group

    return Group(options.replica_check_every, options.replica_tolerance)


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook so that a gradwatch bug detaches gradwatch instead of breaking training."""

    @functools.wraps(hook)
    def run(self: Watcher, *args: Any) -> Any:
        try:
            return hook(self, *args)
        except TrainingHalted:
            raise
        except Exception as exc:
            log.exception("gradwatch: internal error in %s", hook.__name__)
            self._fail(exc)
            return None

    return run


def _closure_at(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """Where ``optimizer.step(closure)`` holds its closure: ``"closure"`` (keyword), the index of
    the positional argument (the step pre-hook's ``args`` start with the optimizer itself), or None.
    """
    if callable(kwargs.get("closure")):
        return "closure"
    first = 1 if args and args[0] is opt else 0
    return first if len(args) > first and callable(args[first]) else None


@dataclass
class _OptEntry:
    count: int  # parameters the optimizer held when indexed
    indices: list[int]  # our parameter indices that it holds


@dataclass
class _Open:
    """The step between its optimizer pre-hook and the start of the next iteration."""

    record: StepRecord
    optimizers: set[int] = field(default_factory=set)
    before: dict[int, torch.Tensor] = field(default_factory=dict)  # weights before the update
    update_idx: list[int] = field(default_factory=list)
    update_parts: list[torch.Tensor] = field(default_factory=list)  # ||delta w|| per parameter
    skip: bool = False  # an action decided that this step changes nothing


class Watcher:
    """Watches one model: measures every optimizer step and streams records to the run.

    Created by :func:`gradwatch.watch`; reach it with :func:`gradwatch.watcher`.
    """

    def __init__(self, model: nn.Module, run_dir: Path, options: Options, config: Config | None = None) -> None:
        config = config if config is not None else Config(None, source="none")
        self.options = options
        self.run_dir = run_dir
        self.rules = config.rules
        self.step = 0
        self.closed = False
        self._status = "finished"
        self._model = weakref.ref(model)
        self._compiled = type(model).__name__ == "OptimizedModule"
        self._found = discover(model, version=1)
        self._measure = Measure(self._found)
        self._index = {id(p): i for i, p in enumerate(self._found.params)}
        inner = unwrap(model)
        meta = {
            **default_meta(),
            "model": type(inner).__name__,
            "parameters": int(sum(self._found.layout.param_numel)),
            "trainable": int(sum(p.numel() for p in self._found.params if p.requires_grad)),
            "options": options.to_dict(),
            "rules": config.describe(),
        }
        self._group = _distributed_group(options)  # None unless one of several ranks of a process group
        self.writes = self._group is None or self._group.writes
        sinks: list[Any] = []
        if not self.writes:  # the other ranks measure and judge alike; rank 0 writes the run and prints
            options = self.options = dataclasses.replace(options, console=False, tensorboard=False, prometheus=None)
        if options.prometheus is not None and options.prometheus is not False:
            from gradwatch.integrations.prometheus import sink_for

            # binds the port first: a port in use fails gw.watch with a clear error and no run written
            sinks.append(sink_for(options.prometheus, run=run_dir.name, model=meta["model"]))
        plugin_actions = build_plugin_actions(config)  # before anything is written: a plugin may fail to build
        fresh = not run_dir.exists()
        try:
            if self.writes:
                if self._group is not None:
                    meta["world_size"] = self._group.size
                sinks.insert(0, Store(create_store(run_dir, meta, overwrite=options.overwrite)))
            if options.tensorboard:
                from gradwatch.sinks.tensorboard import TensorBoard

                sinks.append(TensorBoard(run_dir))
            if self.writes:
                sinks += plugin_sinks(options.sinks, run_dir)
        except BaseException:
            for sink in sinks:
                sink.close("crashed")
            if fresh and self.writes:  # nothing half-written is left behind: the run never started
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self._writer = Writer(
            sinks, queue_size=options.queue_size, flush_seconds=options.flush_seconds, name=run_dir.name
        )
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptEntry]
        self._optimizers = weakref.WeakKeyDictionary()
        self.judge = Judge(config, options, self._writer, plugin_actions)
        self.control = LoopControl(self)
        self._tracker = Tracker(model) if options.origin else None
        self.snapshots: Snapshots | None = None
        if self.judge.rolls_back:
            where = Path(options.snapshot_dir) if options.snapshot_dir is not None else None
            self.snapshots = Snapshots(options.snapshot_keep, where)
        self._since_snapshot = 0
        self._halt: dict[str, Any] | None = None
        #: set by a framework integration, see :meth:`integrate`
        self._on_halt: Callable[[TrainingHalted], None] | None = None
        self._before_step: Callable[[], None] | None = None
        self._signalled = False
        self._leave_out = False  # the coming step is left out (a rollback's skip_batches)
        self._latest: dict[str, float] = {}
        self._current: StepRecord | None = None  # the step being judged
        self._observed: dict[str, list[Any]] = {}
        self._open: _Open | None = None
        self._pending: _Open | None = None
        #: the sentinel's gradient (id, version) after the last backward since the last step
        self._backward: tuple[int, int] | None = None
        #: observations and activations of an iteration that ended without a step, until the
        #: next backward tells whether it was gradient accumulation or a dropped step
        self._carry: tuple[dict[str, list[Any]], list[Any]] | None = None
        self._probe = Probe(
            model,
            on_forward=self._forward_started,
            on_step_pre=self._step_pre,
            on_step_post=self._step_post,
            on_backward_start=self._backward_started,
            on_backward_end=self._backward_done,
        )
        self._sentinel = next(i for i, p in enumerate(self._found.params) if p.requires_grad)
        self._probe.watch_backward(self._found.params[self._sentinel])

    # ------------------------------------------------------------ public API
    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names in model order."""
        return self._found.layout.layers

    def observe(self, **scalars: Any) -> None:
        """Record extra scalars (``loss=``, ``lr=`` ...) for the step that follows.

        Values may be Python numbers or one-element tensors (read with the step's single host
        read, never here). Several values of one name before a step are averaged.
        """
        for name, value in scalars.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"observe({name}=...) needs a scalar, got a tensor of shape {tuple(value.shape)}")
                value = value.detach().reshape(())
            elif not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(
                    f"observe({name}=...) needs a number or a one-element tensor, got {type(value).__name__}"
                )
            self._observed.setdefault(name, []).append(value)

    def flush(self) -> None:
        """Block until every step recorded so far is on disk."""
        self._writer.flush()

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

    def batches(self, iterable: Any) -> Any:
        """Iterate over ``iterable`` (a DataLoader ...), leaving out the batches a rollback skips.

        Example:
            ``for x, y in gw.watcher(model).batches(loader): ...``
        """
        for item in iterable:
            if self.control.pending_skips > 0:
                self.control.pending_skips -= 1
                continue
            yield item

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
        return dict(self._latest)

    # ------------------------------------------------------ integration API
    def integrate(
        self,
        *,
        on_halt: Callable[[TrainingHalted], None],
        signalled: bool = False,
        before_step: Callable[[], None] | None = None,
    ) -> None:
        """Adapt the watcher to a framework that owns the training loop (Lightning, HF Trainer).

        Used by ``gradwatch.integrations``; a plain loop never needs it.

        Args:
            on_halt: called with the :class:`~gradwatch.TrainingHalted` of a halting rule
                instead of raising it out of ``optimizer.step()``, so that the framework stops
                its own loop. The run is closed before the call, and the model's optimizers
                apply nothing at their next step (each gets its gradients back when that
                step ends), so the halted step changes nothing, as in a plain loop.
            signalled: the framework says when gradients are final by calling
                :meth:`gradients_ready`; the optimizer step pre-hooks are then ignored (the
                post-hooks still end each step). For frameworks that call
                ``optimizer.step(closure)``: the pre-hook runs before the closure's backward.
            before_step: called at each step moment before the step is measured, to
                :meth:`observe` values that belong to it or :meth:`leave_out` the step.
        """
        self._on_halt = on_halt
        self._signalled = signalled
        self._before_step = before_step

    def gradients_ready(self, optimizer: torch.optim.Optimizer, *, scaled: bool = False) -> None:
        """The gradients ``optimizer`` is about to apply are final: measure, judge and act now.

        For an integration in signalled mode (:meth:`integrate`). Actions act as in a plain
        loop: clip scales the gradients in place; skip and rollback take them away until
        ``optimizer``'s step ends, so that step changes nothing.

        Args:
            optimizer: the optimizer about to step (the torch optimizer, not a wrapper).
            scaled: a GradScaler steps this optimizer and has unscaled its gradients: non-finite
                gradients are an overflow that the scaler skips (recorded as a skipped step and
                an ``amp_overflow`` finding), not a model failure.

        Raises:
            RuntimeError: the watcher is not in signalled mode.
        """
        if not self._signalled:
            raise RuntimeError("gradients_ready() is for integrations that signal the step moment; "
                               "call watcher.integrate(on_halt=..., signalled=True) first")
        self._signalled_step(optimizer, scaled)

    def leave_out(self) -> bool:
        """Leave the coming step out if a rollback asked to skip batches (:attr:`pending_skips`).

        For integrations, whose frameworks cannot drop a batch from a callback: the step of
        the batch runs but applies nothing, and it is recorded as skipped without being judged.
        Call before the step moment (e.g. from ``before_step``).

        Returns:
            whether the coming step is left out (one pending skip fewer).
        """
        if self.control.pending_skips <= 0:
            return False
        self.control.pending_skips -= 1
        self._leave_out = True
        return True

    # ---------------------------------------------------- used by the control
    def model(self) -> nn.Module:
        """The watched model (the user's module inside any compile/DDP wrapper)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the watched model was garbage-collected")
        return unwrap(model)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping this model's parameters."""
        return [opt for opt, entry in list(self._optimizers.items()) if entry.indices]

    def snapshot_restored(self) -> None:
        """A rollback restored a snapshot: count healthy steps towards the next one afresh."""
        self._since_snapshot = 0

    def halted(self, step: int, reason: str) -> None:
        """A rule halts training at ``step``: write everything and close the run as halted."""
        self._halt = {"step": step, "reason": reason}
        self._open = None
        if self._current is not None:
            self._current.logged = self._current.detail = True
            self._submit(self._current)
            self._current = None
        self.close("halted")

    def close(self, status: str | None = None) -> None:
        """Write what is pending, detach every hook, and close the run (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._open is not None:
                self._close_step()
            if self._tracker is not None:
                self._tracker.clear()
            if self._backward is not None and self._gradients_dropped():
                carry, self._carry = self._carry, None
                self._skipped_step(carry[0] if carry else self._observed)
            if self._pending is not None:
                self._resolve_pending(stats.to_host(self._pending.update_parts))
        finally:
            self._probe.detach()
            self.judge.close()
            final = status or self._status
            self._writer.close(final)
            self._write_verdict(final)
            from gradwatch import registry

            registry.forget(self)

    def _owners(self) -> list[str | None]:
        """The layer each parameter belongs to, in parameter order."""
        layout = self._found.layout
        owners: list[str | None] = [None] * len(layout.params)
        for layer, param in layout.owners:
            owners[param] = layout.layers[layer]
        return owners

    def _write_verdict(self, status: str) -> None:
        if not self.writes:
            return
        summary = self.judge.summary()
        try:
            verdict.write(self.run_dir, {
                "status": status,
                "steps": self.step,
                "worst": summary["worst"],
                "findings": summary["counts"],
                "halted": self._halt,
                "rollbacks": self.control.rollbacks,
            })
        except GradwatchError as exc:  # the run itself is intact in the store
            log.error("gradwatch: could not write the verdict of %s: %s", self.run_dir, exc)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close("crashed" if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt) else None)

    def __repr__(self) -> str:
        return f"Watcher(run={str(self.run_dir)!r}, step={self.step}, closed={self.closed})"

    def _fail(self, exc: Exception) -> None:
        """Detach after an internal error, keeping what was recorded; training is not touched."""
        self._open = self._pending = self._carry = None
        self.close("crashed")
        warnings.warn(
            f"gradwatch stopped watching after an internal error ({exc!r}); training continues unwatched. "
            f"The run so far is in {str(self.run_dir)!r}.",
            InternalWarning,
            stacklevel=3,
        )

    # ----------------------------------------------------------- schedules
    def _sampled(self, step: int) -> bool:
        return step % self.options.sample_period == 0

    def _logged(self, step: int) -> bool:
        return step % self.options.log_every == 0

    # ---------------------------------------------------------------- hooks
    @_guarded
    def _backward_done(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None:
            self._backward = (id(grad), grad._version)

    @_guarded
    def _forward_started(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        if self.closed:
            return
        if self._open is not None:
            self._close_step()
        if self._backward is not None and self._carry is None:
            self._carry = (self._observed, self._probe.take_activations())
            self._observed = {}
        # until the next backward tells, this forward may belong to this step or the next one
        if self._tracker is not None:
            self._tracker.capture(args, kwargs or {})
        upcoming = (self.step, self.step + 1) if self._carry is not None else (self.step,)
        if self.options.activations and not self._compiled and any(self._sampled(s) for s in upcoming):
            self._probe.attach_activations(self._found.leaf_modules)

    def _gradients_dropped(self) -> bool:
        """Whether the gradients of the last backward were cleared (set to None or zeroed)."""
        grad = self._found.params[self._sentinel].grad
        return grad is None or (id(grad), grad._version) != self._backward

    @_guarded
    def _backward_started(self, grad: torch.Tensor | None = None) -> None:
        if self.closed:
            return
        if self._tracker is not None and grad is not None:
            self._tracker.output_grad(grad)
        if self._backward is None:
            return
        dropped = self._gradients_dropped()
        self._backward = None
        if dropped:  # the previous iteration's gradients were dropped without an optimizer step
            carry, self._carry = self._carry, None
            self._skipped_step(carry[0] if carry else {})
        else:
            self._merge_carry()

    def _merge_carry(self) -> None:
        """The iteration that ended without a step was a micro-batch of gradient accumulation."""
        if self._carry is None:
            return
        (observed, acts), self._carry = self._carry, None
        for name, values in self._observed.items():
            observed.setdefault(name, []).extend(values)
        self._observed = observed
        if self._sampled(self.step):
            self._probe.activations[:0] = acts
        else:
            self._probe.detach_activations()  # attached in case this forward began the next step

    def _entry(self, opt: torch.optim.Optimizer) -> _OptEntry | None:
        count = sum(len(g["params"]) for g in opt.param_groups)
        entry = self._optimizers.get(opt)
        if entry is None or entry.count != count:
            held = [p for g in opt.param_groups for p in g["params"]]
            if entry is not None and any(id(p) not in self._index for p in held):
                self._refresh_layout()  # parameters were added to the model and the optimizer
            entry = _OptEntry(count, [self._index[id(p)] for p in held if id(p) in self._index])
            known = opt in self._optimizers
            self._optimizers[opt] = entry
            if not known and entry.indices:
                self._writer.submit_meta(optimizers=sorted({type(o).__name__ for o in self.optimizers()}))
        return entry if entry.indices else None

    def _refresh_layout(self) -> None:
        """Re-discover the model's layers; a changed set gets a new layout version."""
        model = self._model()
        if model is None:
            return
        found = discover(model, version=self._found.layout.version + 1)
        if (found.layout.layers, found.layout.params) == (self._found.layout.layers, self._found.layout.params):
            return
        if self._open is not None:
            self._close_step()
        if self._pending is not None:
            self._resolve_pending(stats.to_host(self._pending.update_parts))
        self._probe.detach_activations()
        self._found, self._measure = found, Measure(found)
        self._index = {id(p): i for i, p in enumerate(found.params)}
        self._optimizers = weakref.WeakKeyDictionary()
        self._sentinel = next(i for i, p in enumerate(found.params) if p.requires_grad)
        self._probe.watch_backward(found.params[self._sentinel])

    @_guarded
    def _step_pre(
        self, opt: torch.optim.Optimizer, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._signalled:
            return None
        kwargs = kwargs or {}
        at = _closure_at(opt, args, kwargs)
        if at is None:
            self._step_at(opt, False)
            return None
        if self.closed or self._entry(opt) is None:
            return None
        # optimizer.step(closure): the gradients exist only once step() has run the closure
        if isinstance(at, str):
            return args, {**kwargs, at: self._measured_closure(opt, kwargs[at])}
        return (*args[:at], self._measured_closure(opt, args[at]), *args[at + 1:]), kwargs

    def _measured_closure(self, opt: torch.optim.Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Wrap a step's closure: the step is measured and judged once its first evaluation has
        computed the gradients, before the optimizer uses them. Later evaluations in the same
        step (L-BFGS line search) are the optimizer's business: no forward, backward or observed
        value of theirs counts as a new iteration. The closure's loss is observed unless the
        closure observed one itself.
        """
        calls = 0

        def measured() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1 or self.closed:
                return self._evaluation_aside(closure)
            loss = closure()
            if "loss" not in self._observed and (
                    (isinstance(loss, torch.Tensor) and loss.numel() == 1) or isinstance(loss, numbers.Real)):
                self.observe(loss=loss)
            self._signalled_step(opt, False)
            return loss

        return measured

    def _evaluation_aside(self, closure: Callable[[], Any]) -> Any:
        """Run a closure with gradwatch's hooks standing aside and its iteration state kept."""
        saved = self._backward, self._observed, self._probe.paused
        self._observed, self._probe.paused = {}, True
        try:
            return closure()
        finally:
            self._backward, self._observed, self._probe.paused = saved

    @_guarded
    def _signalled_step(self, opt: torch.optim.Optimizer, scaled: bool) -> None:
        self._step_at(opt, scaled)

    def _step_at(self, opt: torch.optim.Optimizer, scaled: bool) -> None:
        """The gradients ``opt`` is about to apply are final (its pre-hook, or an integration's signal)."""
        if self.closed or self._entry(opt) is None:
            return
        if self._open is not None and id(opt) in self._open.optimizers:
            self._close_step()  # the same optimizer steps again: a new iteration without a forward
        if self._open is None:
            if self._before_step is not None:
                self._before_step()
            try:
                self._open = self._left_out_step(opt) if self._leave_out else self._begin_step(opt, scaled)
            except TrainingHalted as halt:
                if self._on_halt is None:
                    raise
                self.control.withhold(opt)
                self._on_halt(halt)
                return
            if self._open is None:  # a GradScaler overflow: the scaler will not step
                return
        self._open.optimizers.add(id(opt))
        if self._open.skip:
            entry = self._entry(opt)
            assert entry is not None
            self.control.hold(opt, [self._found.params[i] for i in entry.indices])

    @_guarded
    def _step_post(self, opt: torch.optim.Optimizer) -> None:
        step = self._open
        if step is None:
            return
        if step.skip:
            self.control.give_back(opt)
            return
        entry = self._entry(opt)
        if entry is None or not step.before:
            return
        idx, parts = self._measure.update_norms(step.before, entry.indices)
        step.update_idx += idx
        step.update_parts += parts

    # ------------------------------------------------------------ the step
    @staticmethod
    def _tensor_parts(observed: dict[str, list[Any]]) -> list[torch.Tensor]:
        """The observed values still on the device, read with the step's host read."""
        return [v for values in observed.values() for v in values if isinstance(v, torch.Tensor)]

    def _observed_scalars(self, observed: dict[str, list[Any]], host: np.ndarray) -> dict[str, float]:
        out, k = {}, 0
        for name, values in observed.items():
            nums = []
            for v in values:
                if isinstance(v, torch.Tensor):
                    nums.append(float(host[k]))
                    k += 1
                else:
                    nums.append(float(v))
            out[name] = sum(nums) / len(nums)
        return out

    def _begin_step(self, opt: torch.optim.Optimizer, scaled: bool = False) -> _Open | None:
        """Measure and judge a step; None when it is a GradScaler overflow (``scaled``) the scaler skips."""
        step, now = self.step, time.time()
        self.step += 1
        self._backward = None
        self._merge_carry()
        if step == 0 and self._found.params[self._sentinel].grad is None:
            self._move_sentinel()
        sampled = self._sampled(step)
        launched = self._measure.launch(sampled, self._probe.take_activations() if sampled else [])
        observed, self._observed = self._observed, {}
        obs_parts = self._tensor_parts(observed)
        lr = opt.param_groups[0].get("lr") if "lr" not in observed else None
        lr_parts = [lr] if isinstance(lr, torch.Tensor) else []
        pending = self._pending.update_parts if self._pending is not None else []
        host = stats.to_host([*launched.parts, *obs_parts, *lr_parts, *pending])  # the step's one read
        if launched.sharded and self._group is not None:  # FSDP: the shards' statistics make the model's
            spans = self._measure.spans(launched)
            if pending:
                start = len(launched.parts) + len(obs_parts) + len(lr_parts)
                spans.append((start, start + len(pending), "norm"))
            host = self._group.combine(host, spans)

        k = len(launched.parts)
        vectors = self._measure.vectors(launched, host[:k])
        scalars = self._observed_scalars(observed, host[k:k + len(obs_parts)])
        k += len(obs_parts)
        if lr_parts:
            scalars["lr"], k = float(host[k]), k + 1
        elif isinstance(lr, numbers.Real):
            scalars["lr"] = float(lr)
        if self._pending is not None:
            self._resolve_pending(host[k:])
        if sampled and not self._sampled(step + 1):
            self._probe.detach_activations()
        gnorm = host[:len(launched.gidx)]
        nonfinite = not np.isfinite(gnorm).all()
        total = float(np.sqrt(np.sum(gnorm**2))) if len(gnorm) else math.nan
        if scaled and nonfinite:  # unscaled gradients with inf/NaN: the scaler skips this step
            if self._tracker is not None:
                self._tracker.clear()
            self._finish_skipped(StepRecord(step=step, time=now, layout=self._found.layout, scalars=scalars,
                                            skipped=True, logged=self._logged(step)))
            return None
        record = StepRecord(
            step=step,
            time=now,
            layout=self._found.layout,
            scalars={"grad_norm": total, **scalars},
            vectors=vectors,
            logged=self._logged(step) or nonfinite,
            sampled=sampled,
            detail=sampled or nonfinite,
        )
        return self._judge_step(record, launched, nonfinite)

    def _judge_step(self, record: StepRecord, launched: Any, nonfinite: bool) -> _Open:
        """Find what is wrong with the step and act on it before the optimizer applies it."""
        self._latest = record.scalars
        loss = record.scalars.get("loss")
        loss_finite = loss is None or math.isfinite(loss)
        if self._tracker is not None:
            if nonfinite or not loss_finite:
                self._probe.paused = True
                try:
                    record.origin = self._tracker.find(loss_finite)
                finally:
                    self._probe.paused = False
            self._tracker.clear()
        self.control.begin(record.step, launched.grads, record.scalars["grad_norm"])
        findings = self.judge.check(record)
        if self._group is not None:  # every rank judges the same findings: the same action everywhere
            if self._group.due(record.step):
                findings += self._group.check_replicas(record.step, self._found.params, self._owners())
            findings = self._group.share(findings)
        self._current = record
        try:
            self.judge.step(record, findings, self.control)  # may raise TrainingHalted
        finally:
            self.control.end()
        self._current = None
        if self.control.skipping:
            record.skipped = True
            return _Open(record, skip=True)
        self.control.healthy()
        if self.snapshots is not None and not any(f.severity != "info" for f in findings):
            self._maybe_snapshot(record.step)
        return _Open(record, before=self._measure.snapshot(launched))

    def _maybe_snapshot(self, step: int) -> None:
        """Keep a known-good snapshot every ``snapshot_every`` healthy steps (rollback rules only)."""
        assert self.snapshots is not None
        self._since_snapshot += 1
        if self.snapshots.items and self._since_snapshot < self.options.snapshot_every:
            return
        self._since_snapshot = 0
        self.snapshots.take(step, self.model(), *self.control.objects(), rng_state())

    def _resolve_pending(self, host: np.ndarray) -> None:
        """Complete the previous sampled step with its update norms and hand it to the writer."""
        pending, self._pending = self._pending, None
        assert pending is not None
        self._measure.update_ratios(pending.record.vectors, pending.update_idx, host)
        late = self.judge.check_late(pending.record)
        if late:
            pending.record.logged = pending.record.detail = True
        self._submit(pending.record)
        if late:
            self.judge.defer(late)

    def _submit(self, record: StepRecord) -> None:
        self._writer.submit(record)
        self.judge.remember(record)

    def _close_step(self) -> None:
        step, self._open = self._open, None
        assert step is not None
        step.before.clear()
        if step.update_parts:
            self._pending = step
        else:
            self._submit(step.record)

    def _move_sentinel(self) -> None:
        """Put the sentinel on a parameter that does receive gradients."""
        for i, p in enumerate(self._found.params):
            if p.grad is not None:
                self._sentinel = i
                self._probe.watch_backward(p)
                return

    def _skipped_step(self, observed: dict[str, list[Any]]) -> None:
        """Record an iteration whose gradients were dropped without an optimizer step."""
        step = self.step
        self.step += 1
        self._finish_skipped(self._unmeasured(step, observed))

    def _left_out_step(self, opt: torch.optim.Optimizer) -> _Open:
        """A step an integration leaves out (:meth:`leave_out`): not measured nor judged, not applied."""
        self._leave_out = False
        step = self.step
        self.step += 1
        self._backward = None
        self._merge_carry()
        self._probe.take_activations()
        observed, self._observed = self._observed, {}
        lr = opt.param_groups[0].get("lr")
        if "lr" not in observed and isinstance(lr, (numbers.Real, torch.Tensor)):
            observed["lr"] = [lr]
        record = self._unmeasured(step, observed)
        if not self._sampled(self.step):
            self._probe.detach_activations()
        self._latest = record.scalars
        return _Open(record, skip=True)

    def _unmeasured(self, step: int, observed: dict[str, list[Any]]) -> StepRecord:
        """The record of a step whose gradients are not measured: its observed scalars only."""
        obs_parts = self._tensor_parts(observed)
        pending = self._pending.update_parts if self._pending is not None else []
        host = stats.to_host([*obs_parts, *pending])
        scalars = self._observed_scalars(observed, host[: len(obs_parts)])
        if self._pending is not None:
            self._resolve_pending(host[len(obs_parts):])
        record = StepRecord(step=step, time=time.time(), layout=self._found.layout, scalars=scalars,
                            skipped=True, logged=self._logged(step))
        if self._tracker is not None:
            self._tracker.clear()
        return record

    def _finish_skipped(self, record: StepRecord) -> None:
        """Judge and write a step whose update a GradScaler dropped (findings act at the next step)."""
        self._latest = record.scalars
        findings = self.judge.check(record)
        self._submit(record)
        if findings:
            self.judge.defer(findings)
        if not self._sampled(self.step):
            self._probe.detach_activations()
