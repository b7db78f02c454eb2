"""What the framework callbacks share: ``gw.watch``'s arguments, checked early, and the run's life."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradwatch.errors import TrainingHalted
from gradwatch.watching.registry import check_settings, watch, watcher
from gradwatch.watching.watcher import Watcher

log = logging.getLogger("gradwatch")


class Attachment:
    """One callback's watcher: created when training starts, closed when it ends.

    Args:
        run, rules, log_every, options: exactly :func:`gradwatch.watch`'s keyword arguments,
            validated here, so that a bad option fails when the callback is built, before
            training starts.
    """

    def __init__(self, run: str | Path | None, rules: Any, log_every: int | None, options: dict[str, Any]) -> None:
        check_settings(rules=rules, log_every=log_every, **options)
        self._kwargs: dict[str, Any] = {"run": run, "rules": rules, "log_every": log_every, **options}
        self.watcher: Watcher | None = None
        #: a resumed run whose first step the framework knows (its global step, once its checkpoint is restored)
        self.resumes = bool(options.get("resume")) and options.get("start_step") is None
        #: the halt of this training, once a rule halted it
        self.halt: TrainingHalted | None = None

    @property
    def active(self) -> bool:
        """Whether a watcher is attached and its run still open."""
        return self.watcher is not None and not self.watcher.closed

    def attach(self, model: nn.Module, global_step: int | None = None, **integrate: Any) -> Watcher:
        """Watch ``model`` (or take its existing watcher) and adapt it to the framework; a resumed run
        (``resume=True`` without ``start_step``) goes on from the framework's ``global_step``.
        """
        self.close()  # a callback reused for a second training starts a new run
        self.halt = None
        start: dict[str, Any] = {"start_step": global_step} if self.resumes and global_step is not None else {}
        watch(model, **self._kwargs, **start)
        self.watcher = watcher(model)
        self.watcher.integrate(on_halt=self._halted, **integrate)
        return self.watcher

    def _halted(self, halt: TrainingHalted) -> None:
        self.halt = halt
        log.warning("%s; stopping the trainer", halt)

    def observe(self, **scalars: Any) -> None:
        """Observe scalars for the coming step, while the run is open."""
        if self.active:
            assert self.watcher is not None
            self.watcher.observe(**scalars)

    def close(self, status: str | None = None, detail: dict[str, Any] | None = None) -> None:
        """Close the run (idempotent): finished, or ``status`` (``"crashed"``, ``"terminated"``) with
        ``detail`` (its ``exception``, ``signal``).
        """
        if self.watcher is not None:
            self.watcher.close(status, detail)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (``LightningOptimizer``, ``AcceleratedOptimizer``)."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def loss_scale(scaler: Any) -> torch.Tensor | None:
    """The current scale of an enabled GradScaler, as the device tensor it multiplies by (no read).

    None without a scaler, or before the scaler has scaled anything.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # what GradScaler.scale() multiplies by; get_scale() would sync
    return scale if isinstance(scale, torch.Tensor) else None
