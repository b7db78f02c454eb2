"""Detector ``exploding``: gradient norms far beyond their own recent history, or an absolute bound."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.baseline import Recent, Window
from gradwatch.detectors.causes import EXPLOSION, raised_lr
from gradwatch.store.findings import Finding
from gradwatch.store.records import PRECLIP, Layout, StepRecord
from gradwatch.wording import layer as _layer

#: the longest baseline window: it holds window x layers numbers
MAX_WINDOW = 10_000

HINT = (
    "clip gradients (gw.Rule(when='exploding', do='clip')), lower the learning rate or add warmup, "
    "and check the initialisation scale of the layer named"
)
#: the loop clips its gradients itself (the step carries the norm before clipping)
HINT_CLIPPED = (
    "the loop already clips, which bounds the update but not the cause: lower the learning rate or add "
    "warmup, and check the initialisation scale of the layer named and the batch's samples"
)
HINT_OVERFLOW = (
    "values this large come from an unbounded op (exp of a log-variance, a division by a tiny number, "
    "unnormalised inputs or targets): bound it (clamp, normalise) and lower the learning rate; clipping "
    "cannot rescale a norm that does not fit in float32"
)
#: values a baseline needs before it judges with its wide early bound
EARLY = 3
#: accepted values whose median is the short-term level a jump is measured from
RECENT = 5
#: the steps over which explosions the loop's own clip bounded are counted (``recur``)
RECUR_STEPS = 100


@dataclass
class Exploding(Detector):
    """The global and every layer's gradient norm against their own recent history (log space).

    The baseline of each norm is the median and spread (1.4826 x MAD) of the logs of its last
    ``window`` healthy values. A norm is flagged when ``log(norm) - median > max(z * spread,
    log(ratio))`` once ``warmup`` values are in its window, or ``early_ratio`` times the median
    before that (from the third value on: a baseline is never blind while it warms up), and it is
    also ``jump`` times the median of its last 5 healthy values (a slow trend is not an
    explosion) and ``peak_ratio`` times the largest healthy value in its window (an RNN's
    gradient, whose rare hard samples burst to 5-10 times its median, is judged against that
    tail). Flagged and non-finite norms never enter a window. A layout that renews parameters (a head
    replaced, weights tied, ``load_state_dict(assign=True)``) restarts every baseline: its history was
    another model's.

    A global norm of inf computed from finite gradient elements (their float32 sum of squares
    overflowed) is an explosion, at severity error, from step 0. ``limit`` is an absolute bound
    on the global norm, off by default: a bound is not scale-free (a loss summed over a batch
    gives healthy norms in the thousands).

    When the record carries ``grad_norm_preclip`` (the global norm before a framework clipped
    the gradients, e.g. the HF Trainer's ``max_grad_norm``), the global judgement is of that
    norm: after clipping, the global norm is capped and an explosion would not show.

    Attributes:
        z: robust z-score (in log space) beyond which a norm is flagged.
        ratio: a flagged norm is also at least this many times its typical value.
        layer_ratio: the same for a single layer's norm (layers are noisier than the total).
        limit: the global norm above this is an error whatever its history (0, the default, turns it off).
        window: healthy steps in a baseline.
        warmup: values in a baseline before it judges with ``z`` and ``ratio``.
        early_ratio: before ``warmup`` values, a flagged norm is at least this many times its median.
        jump: a flagged norm is also at least this many times the median of its last 5 healthy values.
        peak_ratio: a flagged norm is also at least this many times the largest healthy value in its
            window (a heavy-tailed gradient is judged against its own tail).
        layer_share: a layer's flagged norm also carries at least this share of the step's squared
            global norm (0.25: at least half the global norm); 0 turns it off.
        min_std: floor of the baseline's spread (log space).
        recur: explosions the loop's own clip bounded (``clip_grad_norm_``, a Trainer's
            ``max_grad_norm``) are info, the update being bounded, until this many within 100
            steps: then a warning (the clip hides a recurring cause).
    """

    kind = "exploding"
    bounds = {"ratio": Bound(1), "layer_ratio": Bound(1), "window": Bound(1, MAX_WINDOW), "warmup": Bound(1, "window"),
              "early_ratio": Bound(1), "jump": Bound(1), "peak_ratio": Bound(1), "layer_share": Bound(0, 1),
              "recur": Bound(1)}
    z: float = 6.0
    ratio: float = 5.0
    layer_ratio: float = 10.0
    limit: float = 0.0
    window: int = 50
    warmup: int = 20
    early_ratio: float = 100.0
    jump: float = 4.0
    peak_ratio: float = 3.0
    layer_share: float = 0.25
    min_std: float = 0.1
    recur: int = 3
    _global: Window = field(init=False, repr=False)
    _layers: Window = field(init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)
    _layout: Layout | None = field(default=None, init=False, repr=False)  # the layout of the latest version
    _bounds: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict, init=False, repr=False)
    _recent: Recent = field(init=False, repr=False)  # each layer's last healthy log norms
    _recent_global: Recent = field(init=False, repr=False)  # the global norm's
    _clipped: list[int] = field(default_factory=list, init=False, repr=False)  # explosions the loop clipped

    def __post_init__(self) -> None:
        self._global = Window(self.window)
        self._layers = Window(self.window, 0)
        self._recent = Recent(RECENT, 0)
        self._recent_global = Recent(RECENT, 1)

    def _bound(self, win: Window, ratio: float) -> np.ndarray:
        """Log of the largest norm each baseline calls normal (inf while warming up).

        Cached until the window next recomputes its statistics.
        """
        cached = self._bounds.get(id(win))
        if cached is not None and cached[0] == win.version:
            return cached[1]
        excess = np.maximum(self.z * np.maximum(win.spread, self.min_std), math.log(ratio))
        early = np.where(win.ready(EARLY), win.center + np.maximum(excess, math.log(self.early_ratio)), np.inf)
        bound = np.where(win.ready(self.warmup), win.center + excess, early)
        self._bounds[id(win)] = (win.version, bound)
        return bound

    def upper(self) -> float:
        """The largest global norm the baseline calls normal (inf while warming up)."""
        return math.exp(float(self._bound(self._global, self.ratio)[0]))

    def typical(self) -> float:
        """The baseline's typical global norm (its median; NaN while empty)."""
        return math.exp(float(self._global.center[0])) if self._global.count[0] else math.nan

    def check(self, record: StepRecord) -> list[Finding]:
        """Judge the step's norms against the baselines, then add the unflagged ones."""
        self.causes.lr_of(record)
        total = record.scalars.get(PRECLIP, record.scalars.get("grad_norm"))
        norms = record.vector("grad_norm")
        if record.skipped or total is None or norms is None:
            return []
        layout = record.layout
        if layout.version != self._version:  # baselines carry over a new layout of the same layers (frozen, unfrozen)
            if not layout.same_layers(self._layout) or layout.renewed:  # renewed: another model's history
                self._layers, self._recent = Window(self.window, len(layout.layers)), Recent(RECENT, len(layout.layers))
                self._bounds.clear()  # a new window may reuse the old one's id
            if layout.renewed:
                self._global, self._recent_global = Window(self.window), Recent(RECENT, 1)
            self._version, self._layout = layout.version, layout
        if not math.isfinite(total):
            # nothing enters the baselines; NaN/Inf elements are the nonfinite detector's
            return self._overflow(record, total, norms)
        log_total = math.log(total) if total > 0 else -math.inf
        # zero and NaN norms (a layer without a gradient, or without parameters): NaN, no baseline value
        logs = np.log(np.where(norms > 0, norms, np.nan), dtype=np.float64)
        valid = np.isfinite(logs)
        lay = self._layers
        g_flag = bool(log_total > self._bound(self._global, self.ratio)[0])
        l_flag = valid & (logs > self._bound(lay, self.layer_ratio))
        jump = math.log(self.jump)  # a flag is also a jump from the short-term level, where that level is known
        # ... and beyond the tail of its own healthy history (a heavy-tailed gradient, such as an
        # RNN's bursts on rare hard samples, is judged against its largest recent values)
        peak = math.log(self.peak_ratio)
        if g_flag:
            level = float(self._recent_global.median(np.zeros(1, dtype=np.intp), EARLY)[0])
            highest = float(self._global.peak(np.zeros(1, dtype=np.intp))[0])
            g_flag = not (log_total - level <= jump or log_total - highest < peak)  # NaN (unknown): stays flagged
        if l_flag.any():
            cols = np.flatnonzero(l_flag)
            l_flag[cols] = ~((logs[cols] - self._recent.median(cols, EARLY) <= jump)
                             | (logs[cols] - lay.peak(cols) < peak))
            # one layer's explosion carries the step: a layer that grows from a tiny gradient to a
            # still small share of the model's (attention keys as a transformer starts to learn) is not one
            applied = record.scalars.get("grad_norm", total)
            l_flag[cols] &= norms[cols].astype(np.float64) ** 2 >= self.layer_share * applied ** 2
        over = self.limit > 0 and total > self.limit
        layer_flag = bool(l_flag.any())
        bad = g_flag or over
        if bad or layer_flag:  # the baselines that judged (the updates below may refresh them)
            center, typical = lay.center, self.typical()
        self._global.update(log_total, not bad)
        self._recent_global.update(log_total, not bad and total > 0)
        if not (bad or layer_flag):  # the usual step: every layer's value enters as it is (NaN: a gap)
            lay.put(logs)
            self._recent.update(logs, True)
            return []
        accepted = valid if not (bad or layer_flag) else valid & ~l_flag & (not bad)
        lay.update(logs, accepted)
        self._recent.update(logs, accepted)
        if not (bad or layer_flag):
            return []
        l_excess = logs - center
        self.causes.note(EXPLOSION, record.step)

        flagged = np.flatnonzero(l_flag)
        top = int(flagged[np.argmax(l_excess[flagged])]) if len(flagged) else None
        layer = layout.layers[top] if top is not None else None
        if bad:
            times = f", {total / typical:.3g}x its typical {typical:.3g}" if math.isfinite(typical) else ""
            where = f"; largest jump in {_layer(layer, layout.layer_types[top])}" if top is not None else ""
            what = "global gradient norm before clipping" if PRECLIP in record.scalars else "global gradient norm"
            message = f"{what} {total:.3g} at step {record.step}{times}{where}."
            value = total
        else:
            assert top is not None
            message = (f"gradient norm of {_layer(layer, layout.layer_types[top])} is {norms[top]:.3g} at step "
                       f"{record.step}, {math.exp(l_excess[top]):.3g}x its typical {math.exp(center[top]):.3g}.")
            value = float(norms[top])
        # the norm judged and its typical value: the global ones, or (a layer's explosion) the layer's
        judged = {"grad_norm": total, "typical": typical} if bad else \
            {"grad_norm": value, "typical": math.exp(center[top]), "global_grad_norm": total}
        data = {**judged, "limit": self.limit if over else None,
                "layers": [layout.layers[i] for i in flagged[np.argsort(-l_excess[flagged])]][:20],
                "hint": HINT_CLIPPED if PRECLIP in record.scalars else HINT}
        message += raised_lr(self.causes, record.step, data)  # still acted on (clipped), but known to follow from it
        severity = "error" if over else "warning"
        # the loop's own clip bounded the update: a one-off is told (info), a recurring one warned of
        pre, post = record.scalars.get(PRECLIP), record.scalars.get("grad_norm")
        if pre is not None and post is not None and post < 0.999 * pre and not over:
            self._clipped = [s for s in self._clipped if record.step - s < RECUR_STEPS] + [record.step]
            if len(self._clipped) >= self.recur:
                message += (f" The loop clipped {len(self._clipped)} explosions in the last {RECUR_STEPS} steps: its "
                            "clip bounds each update, not the cause.")
            elif "lr_raised_at" not in data:  # (a raised learning rate named here stays a warning)
                severity = "info"
                message += f" The loop's clip bounded its update (the global norm clipped to {post:.3g})."
        return [self.finding(record, severity, layer, message, value=value, data=data)]

    def _overflow(self, record: StepRecord, total: float, norms: np.ndarray) -> list[Finding]:
        """A global norm of inf from finite elements: the float32 sum of squares overflowed."""
        counts = record.vector("grad_nonfinite")
        if not math.isinf(total) or counts is None or (np.nan_to_num(counts) > 0).any():
            return []
        self.causes.note(EXPLOSION, record.step)
        layout = record.layout
        inf = np.flatnonzero(np.isinf(norms))
        top = int(inf[-1]) if len(inf) else None  # backward runs in reverse model order: the first to overflow
        layer = layout.layers[top] if top is not None else None
        largest = record.vector("grad_max")
        biggest = float(np.nanmax(largest)) if largest is not None and np.isfinite(largest).any() else None
        value = f" (the largest is {biggest:.3g})" if biggest is not None else ""
        where = f"; first in backward order: {_layer(layer, layout.layer_types[top])}" if top is not None else ""
        what = "global gradient norm before clipping" if PRECLIP in record.scalars else "global gradient norm"
        message = (f"{what} overflows float32 (inf) at step {record.step} although every gradient element is "
                   f"finite{value}: the gradients are astronomically large{where}.")
        data = {"grad_norm": total, "overflow": True, "largest": biggest,
                "layers": [layout.layers[i] for i in inf[::-1]][:20], "hint": HINT_OVERFLOW}
        return [self.finding(record, "error", layer, message, value=total, data=data)]
