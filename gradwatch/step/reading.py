"""Reading a step (the step stage's "measure"): its statistics launched, then read with the observed values,
the learning rate, the pre-clip norms and the previous sampled step's update norms in the step's one host read.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from gradwatch.step import histograms, preclip, stats
from gradwatch.step import observed as obs
from gradwatch.step.measure import Launched
from gradwatch.step.unmeasured import Unmeasured
from gradwatch.store.records import ADAM_EPS, PARAM


@dataclass
class Measured:
    """A step's statistics after its one host read."""

    launched: Launched
    vectors: dict[tuple[str, str], np.ndarray]
    scalars: dict[str, float]
    total: float  # the global gradient norm
    nonfinite: bool  # some gradient holds inf or NaN
    counts: dict[str, int]  # how many values of each observed name the read took
    histograms: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # wandb_histograms, on sampled steps


class Reading(Unmeasured):
    """The steps of one watched model, as far as reading a step's statistics
    (:class:`~gradwatch.step.lifecycle.Lifecycle` adds the step moment, judging and acting).
    """

    def _measure(self, step: int, opt: torch.optim.Optimizer | None) -> Measured:
        """Launch the step's statistics and read them, with the observed values, in one host read."""
        if self.group is not None:  # this step's collectives begin, on every rank alike
            self.group.begin(step, self.found.params, self.guard.moments)
        if step == 0 and self.found.params[self.it.sentinel].grad is None:
            self.it.move_sentinel()
        sampled = self.sampled(step)
        launched = self.measure.launch(sampled, self.it.probe.take_activations() if sampled else [])
        observed, self.it.observed = self.it.observed, {}
        obs_parts = obs.device_parts(observed)
        lr = opt.param_groups[0].get("lr") if opt is not None and "lr" not in observed else None
        lr_parts = [lr] if isinstance(lr, torch.Tensor) else []
        refs, self.it.refs = self.it.refs, None  # changed in place since backward: clipped (or unscaled)
        refs = refs if refs is not None and not launched.sharded and preclip.changed(refs, self.found.params) else None
        scale = self._loss_scale() if refs is not None else None
        ref_parts = preclip.parts(refs, scale) if refs is not None else []
        upd, late = (self.pending.update_parts, self.pending.late_parts()) if self.pending is not None else ([], [])
        hist = histograms.parts(self.found.params) if (sampled and self.options.wandb_histograms
                                                       and not launched.sharded) else []
        attending = self.it.probe.attending
        attn = attending.take()
        attn = attn if sampled else []  # (none are made on an unsampled step's forward call)
        attn_parts = [values for _, values in attn]
        host = stats.to_host([*launched.parts, *obs_parts, *lr_parts, *ref_parts, *upd, *late, *attn_parts,
                              *hist])  # one read
        held = None
        if hist:  # the histograms came last: the rest is read as ever
            n = histograms.size(self.found.params)
            host, held = host[:len(host) - n], histograms.read(host[len(host) - n:], self.found.layout.params)
        attn_host = None
        if attn_parts:  # then the attention statistics
            n = sum(p.numel() for p in attn_parts)
            host, attn_host = host[:len(host) - n], host[len(host) - n:]
        if launched.sharded and self.group is not None:  # FSDP: the shards' statistics make the model's
            spans = self.measure.spans(launched)
            if upd:
                start = launched.size + len(obs_parts) + len(lr_parts)
                spans.append((start, start + sum(p.numel() for p in upd), "norm"))
            host = self.group.combine(host, spans)
        self.measure.rescue(launched, host)  # norms beyond their sum of squares' range, and the unmeasurable
        k = launched.size
        gnorm = host[:len(launched.gidx)]
        total = math.sqrt(float(gnorm @ gnorm)) if len(gnorm) else math.nan
        scalars = obs.scalars(observed, host[k:k + len(obs_parts)])
        if attn_host is not None:
            scalars.update(attending.scalars(attn, attn_host))
        vectors = self.measure.vectors(launched, host[:k], finite=math.isfinite(total),
                                       sound=math.isfinite(scalars.get("loss", 0.0)))
        if sampled:  # the param groups' eps (plain floats) of the optimizers that divide by sqrt(v) + eps
            eps = self.optimizers.adam_eps(len(self.found.params))
            if eps is not None:
                vectors[(PARAM, ADAM_EPS)] = eps
        k += len(obs_parts)
        if lr_parts:
            scalars["lr"], k = float(host[k]), k + 1
        elif type(lr) is float or isinstance(lr, numbers.Real):  # the ABC check costs 10 us: floats first
            scalars["lr"] = float(lr)
        if refs is not None:
            preclip.apply(scalars, refs, host[k:k + len(ref_parts)], gnorm, launched.gidx, total, scale is not None)
            k += len(ref_parts)
        if self.pending is not None:  # the previous sampled step's update norms came with this read
            self._record_pending(host[k:])
        if sampled and not self.sampled(step + 1):
            self.it.probe.detach_activations()
        unmeasured = self.measure.findings(step, self.it.probe.collected.failed)  # said once each (info)
        unmeasured += attending.findings(step)
        if unmeasured:
            self.judge.defer(unmeasured)
        # a finite total means finite norms; an infinite one may come from finite norms (overflow)
        return Measured(launched, vectors, scalars, total, nonfinite=not math.isfinite(total) and not
                        np.isfinite(gnorm).all(), counts={name: len(values) for name, values in observed.items()},
                        histograms=held)

    def _loss_scale(self) -> torch.Tensor | None:
        """The scale of the GradScaler that scaled this step's backward pass, if one did (on the device)."""
        scalers = self.control.objects()[2]
        scale = getattr(scalers[0], "_scale", None) if scalers else None
        return scale if isinstance(scale, torch.Tensor) else None
