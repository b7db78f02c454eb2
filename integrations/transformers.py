"""Hugging Face Trainer: ``GradWatchCallback`` watches the model that a ``Trainer`` trains.

    from gradwatch.integrations.transformers import GradWatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GradWatchCallback(run="runs/exp1")])

- the model is watched from ``on_train_begin``; the run is closed at ``on_train_end``
  (finished) or at a halt (halted);
- the step moment is the optimizer's own step pre-hook, as in a plain loop: after the
  Trainer's gradient clipping (``max_grad_norm``) and, under fp16, after the GradScaler has
  unscaled the gradients and decided to step (an overflow step is recorded as skipped). So
  ``grad_norm`` and every per-layer series are of the gradients the optimizer applies;
- with ``max_grad_norm > 0`` the global norm *before* the Trainer's clipping is recorded every
  step as ``grad_norm_preclip`` (the value the Trainer logs as ``grad_norm``), measured on the
  device when each backward pass ends (after what the backward pass itself queued to run at its
  end, such as DDP's gradient reduction; the last backward before the step counts) and read with
  the step's single host read. The ``exploding`` detector judges it: clipped, the global norm is
  capped at ``max_grad_norm`` and an explosion would not show;
- the loss is the ``loss`` of the model's output (HF models return it when the batch has
  labels): the mean over the step's micro-batches, or their sum when the Trainer has the
  model normalise by the step's token count (``num_items_in_batch``), as the Trainer does;
- a halt sets ``control.should_training_stop`` (the step applies nothing, the reason is
  logged) instead of raising out of ``trainer.train()``.

The Trainer has no callback for an exception: a run whose training raised stays ``running``
until the process exits (then ``crashed``), or call ``callback.close("crashed")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.integrations._attach import Attachment, loss_scale
from gradwatch.rootcause.state import first_tensor
from gradwatch.store.records import PRECLIP
from gradwatch.watching import register

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError:
    raise ImportError(
        "gradwatch.integrations.transformers needs transformers: pip install 'gradwatch[hf]'"
    ) from None

__all__ = ["GradWatchCallback"]


def _model_loss(output: Any) -> torch.Tensor | None:
    """The ``loss`` of a model output (a ``ModelOutput`` or a dict), if it has one."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads``, computed as ``clip_grad_norm_`` does (on the device)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0, error_if_nonfinite=False)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads]))


def _track(watcher: Any, scheduler: Any) -> None:
    """Have a rollback restore the Trainer's LR scheduler.

    Its ``optimizer`` is accelerate's wrapper, so gradwatch's own search (schedulers of the
    model's torch optimizers) does not find it.
    """
    scheduler = getattr(scheduler, "scheduler", scheduler)  # inside an AcceleratedScheduler
    if scheduler is None or watcher is None:
        return
    try:
        watcher.track(scheduler)
    except TypeError:  # not a torch LR scheduler: nothing gradwatch can snapshot
        pass


class GradWatchCallback(TrainerCallback):
    """Watch the model that a ``transformers.Trainer`` trains.

    Takes exactly :func:`gradwatch.watch`'s keyword arguments, checked when the callback is
    built (a bad rule or option raises :class:`gradwatch.ConfigError` before training starts).

    Args:
        run: run directory; default ``runs/<timestamp>-<model class>``.
        rules: ``"default"``, None (record only), a :class:`gradwatch.Rule`, a list, or a
            TOML path, as for :func:`gradwatch.watch`.
        log_every: write per-layer series every this many steps.
        **options: further :func:`gradwatch.watch` options. With ``resume=True`` (and no
            ``start_step``) the run goes on from ``state.global_step``, once
            ``train(resume_from_checkpoint=...)`` has restored it.

    A rollback's ``skip_batches`` cannot drop batches from a callback: the next
    ``skip_batches`` optimizer steps run but apply nothing (recorded as skipped).
    """

    def __init__(self, *, run: str | Path | None = None, rules: Any = "default", log_every: int | None = None,
                 **options: Any) -> None:
        self._attachment = Attachment(run, rules, log_every, options)
        self._handles: list[RemovableHandle] = []
        self._hooks: tuple[Any, ...] = ()  # the backward hooks, made once per watcher
        self._params: list[nn.Parameter] = []
        self._clipping = False
        self._scaler: Any = None
        self._losses: list[torch.Tensor] = []
        self._shares = False  # the losses are shares of the step's loss (normalised by num_items_in_batch)
        self._preclip: torch.Tensor | None = None

    @property
    def watcher(self) -> Any:
        """The :class:`gradwatch.Watcher` of the current (or last) training; None before the first."""
        return self._attachment.watcher

    @property
    def run_dir(self) -> Path | None:
        """The run directory of the current (or last) training."""
        return self.watcher.run_dir if self.watcher is not None else None

    def close(self, status: str | None = None) -> None:
        """Close the run (idempotent): finished, or ``status`` (``"crashed"``); remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._losses, self._preclip = [], None
        self._attachment.close(status)

    # ------------------------------------------------------------ lifecycle
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        """Watch the model."""
        if model is None:
            raise ValueError("GradWatchCallback needs the model: the Trainer passes it to on_train_begin")
        self.close()
        # resume=True: the run goes on from the checkpoint's step (the Trainer restored its state already)
        watcher = self._attachment.attach(model, state.global_step, before_step=self._before_step)
        _track(watcher, lr_scheduler)
        self._clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer under fp16
        # its hooks run through the watcher's guard, as gradwatch's own do
        guard = watcher.guard
        self._hooks = tuple(guard.hook("hf_backward", call)
                            for call in (self._backward_started, self._backward_ending, self._measure_preclip))
        self._handles = [register.forward(model, guard.hook("hf_forward", self._forward), with_kwargs=True)]

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Close the run as finished (unless a halt closed it already)."""
        self.close()

    # ----------------------------------------------------------------- step
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      lr_scheduler: Any = None, **kwargs: Any) -> None:
        """A new optimizer step begins (its first micro-batch)."""
        self._losses, self._preclip = [], None  # what a GradScaler-skipped step left behind
        if self._attachment.active:
            _track(self._attachment.watcher, lr_scheduler)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        """Stop training after a halt."""
        if self._attachment.halt is not None:
            control.should_training_stop = True
        return control

    def _forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training and self._attachment.active):
            return
        loss = _model_loss(output)
        if loss is not None:
            self._losses.append(loss.detach())
            self._shares = kwargs.get("num_items_in_batch") is not None
        out = first_tensor(output)
        if self._clipping and out is not None and out.requires_grad:
            register.tensor(out, self._hooks[0])

    def _backward_started(self, grad: torch.Tensor) -> None:
        register.backward_end(self._hooks[1])

    def _backward_ending(self) -> None:
        # queued again, so that it runs after what was queued during the backward pass (DDP's
        # gradient reduction): the norm is of the gradients the Trainer clips
        register.backward_end(self._hooks[2])

    def _measure_preclip(self) -> None:
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        norm = _total_norm(grads)
        scale = loss_scale(self._scaler)
        self._preclip = norm / scale.to(norm.device) if scale is not None else norm

    def _before_step(self) -> None:
        """The step moment (from the watcher): hand over what belongs to this step."""
        watcher = self._attachment.watcher
        assert watcher is not None
        if self._losses:
            stacked = torch.stack(self._losses)
            watcher.observe(loss=stacked.sum() if self._shares else stacked.mean())
        if self._preclip is not None:
            watcher.observe(**{PRECLIP: self._preclip})
        self._losses, self._preclip = [], None
        watcher.leave_out()
