"""Control of a plain training loop: how actions act, from inside the optimizer step hooks.

- clip scales the gradients in place with a factor computed from the norms already read (no
  extra device sync);
- skip takes every gradient away from the optimizers stepping now (PyTorch optimizers leave a
  parameter whose ``.grad`` is None untouched: no update, no state change, no weight decay) and
  gives it back in their step post-hook, so the step changes nothing;
- rollback restores a snapshot, then skips the step the same way;
- halt raises ``gw.TrainingHalted`` out of ``optimizer.step()`` after the run is closed; under a
  framework integration the watcher catches it, the model's optimizers are :meth:`LoopControl.withhold`-en
  for their next step, and the framework stops its own loop.
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.hooks import RemovableHandle

from gradwatch.errors import RunError, TrainingHalted
from gradwatch.step import snapshots
from gradwatch.step.buffers import Buffers
from gradwatch.store.findings import Finding
from gradwatch.watching import guard as entry
from gradwatch.watching import register

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from gradwatch.step.snapshots import Snapshots


class Loop(Protocol):
    """What the control needs of the watcher it acts for (a :class:`gradwatch.Watcher`)."""

    run_dir: Path
    snapshots: Snapshots | None
    guard: entry.Guard

    def model(self) -> nn.Module:
        """The watched model."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers seen stepping the model."""

    def clip_bound(self) -> float:
        """The adaptive clipping bound (nan when the run has no history yet)."""

    def snapshot_restored(self) -> None:
        """A snapshot was restored."""

    def halted(self, step: int, reason: str) -> None:
        """A rule halts training at ``step``: write everything and close the run."""

    def leave_out_samples(self, ids: list[Any]) -> list[Any]:
        """Add samples to the skip list; returns those that were not in it yet."""


def _is_scheduler(obj: Any) -> bool:
    # called on every object of the process by the scan in objects(): no import statement in here
    return issubclass(type(obj), (LRScheduler, ReduceLROnPlateau))  # type(): no __class__ lookups


def _is_scaler(obj: Any) -> bool:
    return issubclass(type(obj), torch.amp.GradScaler)


class LoopControl:
    """Acts on the optimizers, schedulers and scaler that train a watched model."""

    def __init__(self, watcher: Loop) -> None:
        self._watcher = weakref.proxy(watcher)
        self.grads: list[torch.Tensor] = []
        self.total = math.nan
        self.step = 0
        self.skipping = False
        self.consecutive_skips = 0
        self.rollbacks = 0
        self.pending_skips = 0
        self._held: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._tracked: list[weakref.ref[Any]] = []
        self._last_restored: int | None = None
        self._found: tuple[tuple[int, ...], list[weakref.ref[Any]], list[weakref.ref[Any]]] | None = None
        #: the model's buffers before the step's forward calls: put back when the step is not applied
        self.buffers = Buffers()
        #: the ranks of distributed training (``integrations.distributed.Group``), or None
        self.group: Any = None

    # ---------------------------------------------------------- bookkeeping
    def begin(self, step: int, grads: list[torch.Tensor], total: float) -> None:
        """A new step's gradients (already measured) are about to be applied."""
        self.step, self.grads, self.total, self.skipping = step, grads, total, False

    def end(self) -> None:
        """The step's actions are done: drop the references to its gradients.

        Held any longer, last step's gradients would outlive ``zero_grad(set_to_none=True)``
        and sit in memory beside the next backward's.
        """
        self.grads = []

    def track(self, obj: Any) -> None:
        """Also snapshot and restore this LR scheduler or GradScaler."""
        if not (_is_scheduler(obj) or _is_scaler(obj)):
            raise TypeError(f"track() takes LR schedulers and GradScalers, got {type(obj).__name__}")
        if all(ref() is not obj for ref in self._tracked):
            self._tracked.append(weakref.ref(obj))

    def objects(self) -> tuple[list[torch.optim.Optimizer], list[Any], list[Any]]:
        """The optimizers of the model, and the LR schedulers and GradScaler that go with them.

        Schedulers of these optimizers and an enabled GradScaler are found once by a scan of
        the garbage collector's objects (again when the set of optimizers changes); objects
        given to :meth:`track` are always included.
        """
        optimizers = self._watcher.optimizers()
        key = tuple(id(o) for o in optimizers)
        if self._found is None or self._found[0] != key:
            ids = set(key)
            # one pass over every object of the process, no call per object (a long session holds
            # hundreds of thousands)
            kinds = (LRScheduler, ReduceLROnPlateau, torch.amp.GradScaler)
            objs = [o for o in gc.get_objects() if issubclass(type(o), kinds)]
            schedulers = [o for o in objs if _is_scheduler(o) and id(getattr(o, "optimizer", None)) in ids]
            scalers = [o for o in objs if _is_scaler(o) and o.is_enabled()][:1]
            self._found = (key, [weakref.ref(o) for o in schedulers], [weakref.ref(o) for o in scalers])
        tracked = [ref() for ref in self._tracked]
        schedulers = [o for o in (r() for r in self._found[1]) if o is not None]
        scalers = [o for o in (r() for r in self._found[2]) if o is not None]
        schedulers += [o for o in tracked if o is not None and _is_scheduler(o) and o not in schedulers]
        explicit = [o for o in tracked if o is not None and _is_scaler(o)]
        return optimizers, schedulers, explicit or scalers

    # -------------------------------------------------------------- actions
    @torch.no_grad()
    def clip(self, max_norm: float | None) -> dict[str, Any]:
        """Scale the step's gradients so that their global norm is at most ``max_norm``."""
        if max_norm is None:
            max_norm = self._watcher.clip_bound()
            adaptive = True
        else:
            adaptive = False
        total = self.total
        if math.isinf(total) and self.grads:  # finite elements whose float32 sum of squares overflowed
            total = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float64) for g in self.grads])))
        if not math.isfinite(max_norm) or not math.isfinite(total) or total <= max_norm:
            return {"clipped": False, "max_norm": max_norm, "adaptive": adaptive}
        coef = max_norm / (total + 1e-6)
        torch._foreach_mul_(self.grads, coef)
        return {"clipped": True, "max_norm": max_norm, "adaptive": adaptive, "coef": coef}

    def skip(self, max_consecutive: int) -> dict[str, Any]:
        """Make this step change nothing."""
        self.consecutive_skips += 1
        if max_consecutive and self.consecutive_skips > max_consecutive:
            self.halt(None, f"{max_consecutive} steps in a row had to be skipped")
        self.skipping = True
        return {"skipped": True, "consecutive": self.consecutive_skips, **self.buffers.restore(self.step)}

    def rollback(self, skip_batches: int, lr_scale: float, max_rollbacks: int) -> dict[str, Any]:
        """Restore the last known-good snapshot and skip this step.

        In distributed training every rank does the same: it restores the newest snapshot that every
        rank holds intact; where some rank holds none, every rank skips the step; where none is intact
        everywhere, every rank halts (see :meth:`_agreed`).
        """
        store = self._watcher.snapshots
        candidates = [s for s in store.items if s.step <= self.step] if store is not None else []
        if len(candidates) > 1 and candidates[-1].step == self._last_restored:
            candidates.pop()  # the trouble came back before a newer snapshot: go further back
        lacking: list[int] = []
        if self.group is not None:
            if self.group.check_every > 0:
                self.group.check_next = True  # the replicas are compared at the next step: still one model?
            common, lacking = self.group.common_steps([s.step for s in candidates])
            candidates = [s for s in candidates if s.step in common]
        if store is None or not candidates:
            self.skipping = True
            reason = "no snapshot yet; the step was skipped instead"
            if lacking:
                reason = (f"rank{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))} of "
                          f"{self.group.size} could not keep a snapshot; every rank skipped the step instead")
            return {"rolled_back": False, "reason": reason, **self.buffers.restore(self.step),
                    **({"ranks_without_snapshot": lacking} if lacking else {})}
        if self.rollbacks >= max_rollbacks:
            self.halt(None, f"training needed more than {max_rollbacks} rollbacks")
        problems: list[str] = []
        self.buffers.restore(self.step)  # the step's forward calls undone; a snapshot's buffers then replace them
        for snap in reversed(candidates):
            saved = self._agreed(store, snap, problems)
            if saved is not None:
                snapshots.restore(saved, self._watcher.model(), *snap.targets)
                break
        else:
            self.halt(None, "no intact snapshot to roll back to" + (f" ({'; '.join(problems)})" if problems else ""))
        self.rollbacks += 1
        self._last_restored = snap.step
        self.pending_skips += skip_batches
        if lr_scale != 1.0:
            self.scale_lr(lr_scale)
        self.skipping = True
        self._watcher.snapshot_restored()
        return {"rolled_back": True, "restored_step": snap.step, "rollbacks": self.rollbacks,
                "skip_batches": skip_batches, "lr_scale": lr_scale, "refused": problems,
                **({"ranks_without_snapshot": lacking} if lacking else {})}

    def _agreed(self, store: Snapshots, snap: snapshots.Snapshot, problems: list[str]) -> dict[str, Any] | None:
        """The state of ``snap`` when it is intact here (and, in distributed training, on every rank)."""
        try:
            saved = store.load(snap)
        except RunError as exc:  # never restore a corrupted snapshot; try an older one
            problems.append(str(exc))
            saved = None
        if self.group is not None and not self.group.everywhere(saved is not None):
            if saved is not None:
                problems.append(f"the snapshot of step {snap.step} is not intact on every rank")
            return None
        return saved

    def scale_lr(self, factor: float) -> dict[str, Any]:
        """Multiply every parameter group's LR (and the schedulers' base LRs) by ``factor``."""
        optimizers, schedulers, _ = self.objects()
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * factor
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * factor
        for sched in schedulers:
            if hasattr(sched, "base_lrs"):
                sched.base_lrs = [lr * factor for lr in sched.base_lrs]
            if hasattr(sched, "_last_lr"):
                sched._last_lr = [lr * factor for lr in sched._last_lr]
        lrs = [g["lr"] for opt in optimizers for g in opt.param_groups]
        return {"factor": factor, "lr": float(lrs[0]) if lrs else None}

    def skip_samples(self, finding: Finding) -> dict[str, Any]:
        """Leave the samples ``finding`` blames out of the batches drawn from now on (by their ids)."""
        samples = finding.data.get("samples") or {}
        ids = [i for i in (samples.get("ids") or []) if i is not None]
        if not samples.get("indices"):
            return {"samples_skipped": [], "samples_reason": "the finding blames no sample"}
        if not ids:
            return {"samples_skipped": [], "samples_reason": "the blamed samples have no ids: pass "
                    "observe(sample_ids=...) or iterate with watcher.batches(loader)"}
        new = self._watcher.leave_out_samples(ids)
        return {"samples_skipped": ids, "samples_new": len(new)}

    def halt(self, finding: Finding | None, reason: str | None = None) -> None:
        """Close the run as halted and raise TrainingHalted from the optimizer step."""
        step = finding.step if finding is not None else self.step
        what = reason or (finding.message if finding is not None else "a rule halted training")
        message = f"gradwatch halted training at step {step}: {what} (run: {self._watcher.run_dir})"
        self.buffers.restore(self.step)  # the model as it was before the step, buffers included
        self._watcher.halted(step, what)
        raise TrainingHalted(message, step=step, finding=finding)

    # ------------------------------------------------- skipping the optimizer
    def hold(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        """Take the gradients of ``params`` away before ``opt`` steps (the step is skipped)."""
        held = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        self._held[id(opt)] = held

    def give_back(self, opt: torch.optim.Optimizer) -> None:
        """Return the gradients taken before ``opt`` stepped."""
        for p, grad in self._held.pop(id(opt), []):
            p.grad = grad

    def withhold(self, current: torch.optim.Optimizer) -> None:
        """After a halt that does not raise: no optimizer of the model applies its next step.

        ``current`` is about to step: its gradients are taken away now; the model's other
        optimizers lose theirs when they next step. Each gets them back when that step ends,
        through one-shot hooks of its own (the watcher's hooks are gone once the run is closed).
        """
        others = [o for o in self._watcher.optimizers() if o is not current]
        _withhold_once(current, self._watcher.guard, now=True)
        for opt in others:
            _withhold_once(opt, self._watcher.guard, now=False)

    def healthy(self) -> None:
        """The step was applied normally."""
        self.consecutive_skips = 0


def _withhold_once(opt: torch.optim.Optimizer, guard: entry.Guard, *, now: bool) -> None:
    """Make ``opt``'s next step change nothing: its parameters have no gradient during it."""
    params = [p for group in opt.param_groups for p in group["params"]]
    held: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    handles: list[RemovableHandle] = []

    def take(*_: Any) -> None:
        held.extend((p, p.grad) for p in params)
        for p in params:
            p.grad = None

    def give_back(*_: Any) -> None:
        for p, grad in held:
            p.grad = grad
        held.clear()
        for handle in handles:
            handle.remove()

    handles.append(register.optimizer(opt, guard.hook("withhold", give_back), pre=False))
    if now:
        take()
    else:
        handles.append(register.optimizer(opt, guard.hook("withhold", take), pre=True))
