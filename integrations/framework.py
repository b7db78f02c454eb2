"""The framework API of a watcher: what an integration calls when a framework owns the training loop.

Lightning and the Hugging Face Trainer (:mod:`gradwatch.integrations.lightning`,
:mod:`gradwatch.integrations.transformers`) cannot let gradwatch raise out of ``optimizer.step()`` or
drop a batch; they call :meth:`FrameworkAPI.integrate` once, then tell the step moment
(:meth:`~FrameworkAPI.gradients_ready`) and leave steps out (:meth:`~FrameworkAPI.leave_out`). A plain
loop never needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from gradwatch.errors import TrainingHalted
from gradwatch.store.records import LAYER, present

if TYPE_CHECKING:
    from gradwatch.step.control import LoopControl
    from gradwatch.step.lifecycle import Lifecycle


class FrameworkAPI:
    """The methods of :class:`~gradwatch.watching.watcher.Watcher` for framework integrations."""

    _steps: Lifecycle
    control: LoopControl

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
        steps = self._steps
        steps.on_halt, steps.signalled, steps.before_step = on_halt, signalled, before_step

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
        if not self._steps.signalled:
            raise RuntimeError("gradients_ready() is for integrations that signal the step moment; "
                               "call watcher.integrate(on_halt=..., signalled=True) first")
        self._steps.signalled_step(optimizer, scaled)

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
        self._steps.leave_out = True
        return True

    def step_layers(self, metrics: Iterable[str]) -> tuple[int, bool, dict[str, dict[str, float]]]:
        """Per-layer values of the step whose moment just passed (:meth:`gradients_ready`), from its host read.

        Nothing is read from the device: the values are the ones the step measured.

        Args:
            metrics: per-layer metric names (``grad_norm``, ``param_norm``, ``grad_max``, ``act_norm`` ...).

        Returns:
            ``(step, sampled, {metric: {layer: value}})``: the step, whether it was sampled (its costlier
            statistics measured), and of each metric measured on it the layers that hold a value (a layer
            without a gradient holds none; a NaN gradient is a value). ``(-1, False, {})`` when no step is
            open (a GradScaler's overflow step, a halted step, a closed run).
        """
        open_ = self._steps.open
        if open_ is None or self._steps.closed:
            return -1, False, {}
        record = open_.record
        out: dict[str, dict[str, float]] = {}
        for metric in metrics:
            if (LAYER, metric) in record.vectors:
                values, held = record.vectors[(LAYER, metric)], present(record, LAYER, metric)
                out[metric] = {name: float(v) for name, v, h in zip(record.layout.layers, values, held, strict=True)
                               if h}
        return record.step, record.sampled, out

    def _forward_started(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """A forward began before the watcher's hooks existed (a model watched from its first forward)."""
        self._steps.it.forward_started(args, kwargs or {})
