"""Lightning: ``GradWatchCallback`` watches a LightningModule through the Trainer's hooks.

    from gradwatch.integrations.lightning import GradWatchCallback
    trainer = Trainer(callbacks=[GradWatchCallback(run="runs/exp1")])

- the module is watched from ``on_fit_start``; the run is closed at ``on_train_end`` (finished),
  at a halt (halted) or in ``on_exception``: terminated (signal 15) when Lightning's own SIGTERM
  handling stops the fit (a preempted job), else crashed;
- the step moment is ``on_before_optimizer_step``: after backward and after the GradScaler's
  unscale under AMP, before Lightning's own gradient clipping (``gradient_clip_val``) and the
  optimizer's update. (Lightning calls ``optimizer.step(closure)``: the optimizer's step
  pre-hook runs before the closure's forward and backward, so it cannot be the step moment.)
  Clip, skip and rollback act there, as in a plain loop;
- the loss is taken in ``on_before_backward`` (undoing Lightning's division by
  ``accumulate_grad_batches`` and the GradScaler's scaling; a device tensor, read with the
  step's single host read);
- a halt sets ``trainer.should_stop`` (the step applies nothing, the reason is logged) instead
  of raising out of ``trainer.fit``;
- ``gradwatch/grad_norm``, ``gradwatch/warnings``, ``gradwatch/errors`` (counted as ``gradwatch
  check`` counts them) and ``gradwatch/repeats`` (their folded repeats) go to the Trainer's logger
  every step, and ``gradwatch/<metric>/<layer>`` (``layer_metrics``) on the steps gradwatch samples,
  from numbers already read.

Works with ``lightning.pytorch``, or ``pytorch_lightning`` when only that is installed.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradwatch.errors import ConfigError
from gradwatch.integrations._attach import Attachment, loss_scale, unwrap_optimizer
from gradwatch.watching.ending import described_exception

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - the standalone package
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[no-redef,assignment]
    except ImportError:
        raise ImportError(
            "gradwatch.integrations.lightning needs Lightning: pip install 'gradwatch[lightning]'"
        ) from None

__all__ = ["LAYER_METRICS", "GradWatchCallback"]

#: the per-layer metrics ``layer_metrics`` may name: those a sampled step has measured at its moment (an
#: ``update_ratio`` needs the update, read with the next step's: it is in the run, not sent to the logger)
LAYER_METRICS = ("grad_norm", "grad_max", "grad_nonfinite", "param_norm", "act_norm", "act_zero_frac", "act_sat_frac")


class GradWatchCallback(Callback):
    """Watch the LightningModule that a ``Trainer`` fits.

    Takes exactly :func:`gradwatch.watch`'s keyword arguments, and ``layer_metrics``, checked when the
    callback is built (a bad rule or option raises :class:`gradwatch.ConfigError` before training starts).

    Args:
        run: run directory; default ``runs/<timestamp>-<module class>``.
        rules: ``"default"``, None (record only), a :class:`gradwatch.Rule`, a list, or a
            TOML path, as for :func:`gradwatch.watch`.
        log_every: write per-layer series every this many steps.
        layer_metrics: the per-layer metrics sent to the Trainer's loggers as
            ``gradwatch/<metric>/<layer>`` on each step gradwatch samples (every ``sample_every``
            steps: ``grad_norm`` of every layer by default); ``()`` or None sends none. Names
            among :data:`LAYER_METRICS`.
        **options: further :func:`gradwatch.watch` options. With ``resume=True`` (and no
            ``start_step``) the run goes on from ``trainer.global_step``, once
            ``fit(ckpt_path=...)`` has restored it.

    Activation statistics and the replay that finds where a NaN was born hook the module's
    ``forward``: have ``training_step`` call ``self(x)`` (the usual style). A rollback's
    ``skip_batches`` cannot drop batches from a callback: the next ``skip_batches`` steps run
    but apply nothing (recorded as skipped).
    """

    def __init__(self, *, run: str | Path | None = None, rules: Any = "default", log_every: int | None = None,
                 layer_metrics: Sequence[str] | None = ("grad_norm",), **options: Any) -> None:
        self._attachment = Attachment(run, rules, log_every, options)
        self._trainer: Trainer | None = None
        if isinstance(layer_metrics, str):
            layer_metrics = (layer_metrics,)
        self._layer_metrics = tuple(dict.fromkeys(layer_metrics or ()))
        unknown = [m for m in self._layer_metrics if m not in LAYER_METRICS]
        if unknown:
            raise ConfigError(f"layer_metrics: {unknown[0]!r} is not a per-layer metric a step measures at its "
                              f"moment; choose among {', '.join(LAYER_METRICS)}")

    @property
    def watcher(self) -> Any:
        """The :class:`gradwatch.Watcher` of the current (or last) fit; None before the first."""
        return self._attachment.watcher

    @property
    def run_dir(self) -> Path | None:
        """The run directory of the current (or last) fit."""
        return self.watcher.run_dir if self.watcher is not None else None

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Watch the module; the callback signals the step moment itself."""
        self._trainer = trainer
        if not self._attachment.resumes:  # a resumed run waits for the checkpoint's step: on_train_start
            self._attachment.attach(pl_module, signalled=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Watch a resumed run (``resume=True``) from the step its checkpoint restored (``trainer.global_step``)."""
        if self._attachment.resumes and not self._attachment.active:
            self._attachment.attach(pl_module, trainer.global_step, signalled=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the run as finished (unless a halt closed it already)."""
        self._attachment.close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Close the run as ``terminated`` when Lightning stops on a SIGTERM (its ``SIGTERMException``: a
        preempted job), else as ``crashed`` with the exception (an interrupt closes it as finished, like
        ``with watcher:``).
        """
        if isinstance(exception, KeyboardInterrupt):
            self._attachment.close()
        elif getattr(trainer, "received_sigterm", False):
            self._attachment.close("terminated", {"signal": int(signal.SIGTERM)})
        else:
            self._attachment.close("crashed", {"exception": described_exception(type(exception), exception)})

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Close the run if nothing else did."""
        self._attachment.close()

    # ----------------------------------------------------------------- step
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Observe the training step's loss, as ``training_step`` returned it."""
        if not self._attachment.active:
            return
        value = loss.detach()
        scale = loss_scale(getattr(trainer.precision_plugin, "scaler", None))
        if scale is not None:
            value = value / scale.to(value.device)
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            value = value * trainer.accumulate_grad_batches
        self._attachment.observe(loss=value)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """The step moment: measure, judge and act before Lightning clips and the optimizer steps."""
        attachment = self._attachment
        watcher = attachment.watcher
        if watcher is None or watcher.closed:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        watcher.leave_out()
        watcher.gradients_ready(unwrap_optimizer(optimizer), scaled=scaler is not None and scaler.is_enabled())
        if attachment.halt is not None:
            trainer.should_stop = True
        summary = watcher.findings
        counts, repeats = summary["counts"], summary["repeats"]
        pl_module.log_dict(
            {  # findings as ``check`` counts them (one per stored finding); their folded repeats apart
                "gradwatch/grad_norm": watcher.latest.get("grad_norm", math.nan),
                "gradwatch/warnings": float(counts["warning"] - repeats["warning"]),
                "gradwatch/errors": float(counts["error"] - repeats["error"]),
                "gradwatch/repeats": float(repeats["warning"] + repeats["error"]),
            },
            on_step=True, on_epoch=False, prog_bar=False, logger=bool(trainer.loggers),
        )
        if self._layer_metrics and trainer.loggers:
            self._log_layers(trainer, watcher)

    def _log_layers(self, trainer: Trainer, watcher: Any) -> None:
        """The sampled step's per-layer values, straight to the loggers at the step Lightning logs this batch at.

        Not through ``LightningModule.log``: a value logged on some steps only would be repeated, stale, on
        the steps Lightning flushes its logs at (``log_every_n_steps``).
        """
        _, sampled, values = watcher.step_layers(self._layer_metrics)
        if not sampled:
            return
        metrics = {f"gradwatch/{metric}/{layer}": value for metric, layers in values.items()
                   for layer, value in layers.items()}
        if not metrics:
            return
        # the step Lightning's own logging of this batch uses (its logger connector's), else the global step
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
