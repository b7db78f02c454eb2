"""Detector ``exploding``: gradient norms far beyond their own recent history, or an absolute bound."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors import Detector
from gradwatch.detectors.baseline import Ema
from gradwatch.findings import Finding
from gradwatch.records import StepRecord

HINT = (
    "clip gradients (gw.Rule(when='exploding', do='clip')), lower the learning rate or add warmup, "
    "and check the initialisation scale of the layer named"
)


@dataclass
class Exploding(Detector):
    """The global and every layer's gradient norm against their own EMA baseline (in log space).

    A norm is flagged when ``log(norm) - mean > max(z * std, log(ratio))`` once ``warmup``
    steps have entered its baseline, or when the global norm exceeds ``limit``. Flagged and
    non-finite norms never enter a baseline.

    Attributes:
        z: z-score (in log space) beyond which a norm is flagged.
        ratio: a flagged norm is also at least this many times its baseline.
        layer_ratio: the same for a single layer's norm (layers are noisier than the total).
        limit: the global norm above this is an error whatever its history (0 turns it off).
        beta: EMA decay of the baselines (about 1 / (1 - beta) steps of memory).
        warmup: steps in a baseline before it judges.
        min_std: floor of the baseline's spread (log space).
    """

    kind = "exploding"
    z: float = 6.0
    ratio: float = 5.0
    layer_ratio: float = 10.0
    limit: float = 1e4
    beta: float = 0.98
    warmup: int = 20
    min_std: float = 0.1
    _global: Ema = field(init=False, repr=False)
    _layers: Ema = field(init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        self._global = Ema(self.beta)
        self._layers = Ema(self.beta, 0)

    def upper(self) -> float:
        """The largest global norm the baseline calls normal (inf while warming up)."""
        if not self._global.ready(self.warmup):
            return math.inf
        excess = max(self.z * float(self._global.std(self.min_std)), math.log(self.ratio))
        return math.exp(float(self._global.mean) + excess)

    def typical(self) -> float:
        """The baseline's typical global norm (its geometric mean; NaN while empty)."""
        return math.exp(float(self._global.mean)) if self._global.count else math.nan

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the step's norms against the baselines, then fold the unflagged ones in."""
        total = record.scalars.get("grad_norm")
        norms = record.vector("grad_norm")
        if record.skipped or total is None or norms is None:
            return []
        layout = record.layout
        if layout.version != self._version:
            self._layers, self._version = Ema(self.beta, len(layout.layers)), layout.version
        if not math.isfinite(total):
            return []  # the nonfinite detector's; and nothing enters the baselines
        log_total = math.log(total) if total > 0 else -math.inf
        g = self._global
        g_excess = log_total - float(g.mean)
        g_flag = bool(g.ready(self.warmup)) and g_excess > max(self.z * float(g.std(self.min_std)), math.log(self.ratio))
        over = self.limit > 0 and total > self.limit

        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log(norms.astype(np.float64))
        valid = np.isfinite(logs)
        lay = self._layers
        l_excess = logs - lay.mean
        l_flag = valid & lay.ready(self.warmup) & (
            l_excess > np.maximum(self.z * lay.std(self.min_std), math.log(self.layer_ratio)))
        if not (g_flag or over):
            g.update(log_total)
        lay.update(logs, valid & ~l_flag & ~(g_flag or over))
        if not (g_flag or over or l_flag.any()):
            return []

        flagged = np.flatnonzero(l_flag)
        top = int(flagged[np.argmax(l_excess[flagged])]) if len(flagged) else None
        layer = layout.layers[top] if top is not None else None
        typical = math.exp(float(g.mean)) if g.count else math.nan
        if g_flag or over:
            times = f", {total / typical:.3g}x its typical {typical:.3g}" if g.count else ""
            where = f"; largest jump in {layer} ({layout.layer_types[top]})" if top is not None else ""
            message = f"global gradient norm {total:.3g} at step {record.step}{times}{where}."
            value = total
        else:
            assert top is not None
            message = (f"gradient norm of {layer} ({layout.layer_types[top]}) is {norms[top]:.3g} at step "
                       f"{record.step}, {math.exp(l_excess[top]):.3g}x its typical {math.exp(lay.mean[top]):.3g}.")
            value = float(norms[top])
        severity = "error" if over else "warning"
        data = {"grad_norm": total, "typical": typical, "limit": self.limit if over else None,
                "layers": [layout.layers[i] for i in flagged[np.argsort(-l_excess[flagged])]][:20], "hint": HINT}
        return [self.finding(record, severity, layer, message, value=value, data=data)]
