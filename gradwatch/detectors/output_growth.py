"""Detector ``output_growth``: linear layers' outputs growing step after step, a precursor of divergence.

Rybakov et al. 2024 ("Methods of improving LLM training stability"): at a too-high learning rate the L2 norms
of a transformer's linear layers' outputs -- the QKV projection, the attention's output projection and the
second MLP layer -- grow on every measured step until the model diverges. Healthy training grows them too,
early, from a small initialisation, but that growth slows down and levels off; this growth compounds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.detectors.following import Following
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import listed, plural

HINT = (
    "lower the learning rate or lengthen its warmup; normalise the outputs of the QKV projection, the "
    "attention's output projection and the second MLP layer (qk-layernorm, Rybakov et al.'s QKV/Proj/FC2 "
    "norm), cap the attention softmax's logits, add weight decay; gradient clipping does not stop it (the "
    "weights grow by many small steps)"
)
#: the leaf types whose outputs are judged: ``nn.Linear``, the out-projection of ``nn.MultiheadAttention``, and
#: Hugging Face's ``Conv1D`` (GPT-2's linear layer); a parametrized one (``ParametrizedLinear``) as its own type
LINEAR = frozenset({"Linear", "NonDynamicallyQuantizableLinear", "Conv1D", "LazyLinear"})
#: compounding, not saturating: over the judged window, the growth of its later half (in log) is at least this
#: share of its earlier half's (growth that slows down -- a power of the step, as from a small initialisation --
#: has a later half far slower than its earlier half once it has grown ``growth`` times)
COMPOUNDING = 0.75


def linear(type_: str) -> bool:
    """Whether a leaf of this type is a linear layer whose outputs are judged."""
    return type_.removeprefix("Parametrized") in LINEAR


@dataclass
class OutputGrowth(Detector):
    """A linear layer's output norm (``act_norm``, measured on sampled steps) grows on each of the last
    ``patience`` measurements and by ``growth`` times or more over the last ``2 x patience``, to ``growth`` times
    or more its early level (the largest of its first ``2 x patience + 1`` measurements), at a pace that
    does not slow down (the later half of that window grew at least ``COMPOUNDING`` (0.75) as much, in log, as
    the earlier half): compounding growth, Rybakov et al.'s precursor of divergence at a too-high learning rate.

    Healthy training grows these outputs too, early (from a small initialisation, under a warmup), but that
    growth slows down as it goes and levels off. Growth while the learning rate rose over the window (a warmup)
    is the warmup's, not judged, and so is growth within 100 steps of a learning rate named too high (that finding
    names the cause). Judged on Linear-type leaves (``Linear``, ``NonDynamicallyQuantizableLinear``, Hugging
    Face's ``Conv1D``) but the last in model order: the output layer, whose outputs are logits that grow as the
    model grows confident (z-loss's subject, not this). The output norm is the L2 norm of the whole output: a
    batch whose size changes changes it, so only a rise on every measurement in a row counts, never one jump. A
    step where a layer was not measured (NaN) is left out of its history; a non-finite norm is ``nonfinite``'s
    and restarts it, as renewed parameters (``Layout.renewed``) do.

    The layers that qualify on one step are one finding (warning), at the first of them in model order,
    naming them all (``data["layers"]``, ``data["count"]``); a layer is named once per rise. Once the loss
    follows (:class:`~gradwatch.detectors.following.Following`: its level 1.5x its lowest since the warning,
    or NaN/Inf) the mechanism is an error, a new finding, once per episode.

    Attributes:
        patience: consecutive sampled measurements on which the output norm rose.
        growth: how many times the output norm grew, at least, over the last ``2 x patience`` measurements.
    """

    kind = "output_growth"
    bounds = {"patience": Bound(2), "growth": Bound(1, open_low=True)}
    patience: int = 4
    growth: float = 16.0
    #: per layer: its latest measurements (step, log of the output norm), oldest first
    _history: dict[str, deque[tuple[int, float]]] = field(default_factory=dict, init=False, repr=False)
    _told: set[str] = field(default_factory=set, init=False, repr=False)  # layers named during their current rise
    #: per layer: the largest log output norm of its first ``2 x patience + 1`` measurements (its early level)
    _early: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _lr: dict[int, float] = field(default_factory=dict, init=False, repr=False)  # the learning rate of sampled steps
    _version: int = field(default=-1, init=False, repr=False)
    _following: Following = field(default_factory=Following, init=False, repr=False)
    _named: Finding | None = field(default=None, init=False, repr=False)  # the warning that armed the watch

    def check(self, record: StepRecord) -> list[Finding]:
        """Extend each linear layer's history on a sampled step; judge it; escalate when the loss follows."""
        out = self._grown(record) if record.sampled and not record.skipped else []
        return out + self._followed(record)

    def _grown(self, record: StepRecord) -> list[Finding]:
        norms = record.vector("act_norm")
        if norms is None:
            return []
        layout = record.layout
        if layout.version != self._version:
            self._version = layout.version
            for i in layout.renewed:  # other weights than the history was of: it restarts
                self._forget(layout.layers[i])
        lr = record.scalars.get("lr")
        if lr is not None and math.isfinite(lr):
            self._lr[record.step] = lr
        keep = 2 * self.patience + 1
        found: list[tuple[int, float, float, int, float]] = []  # (leaf, from, to, from step, per step)
        judged = [i for i in layout.leaves if linear(layout.layer_types[i])]
        for i in judged[:-1]:  # the last is the output layer: its outputs are logits, which grow as it grows confident
            name, value = layout.layers[i], float(norms[i])
            if math.isnan(value):
                continue  # not measured on this step
            if not math.isfinite(value) or value <= 0:
                self._forget(name)  # a NaN/Inf output is nonfinite's; an all-zero one has no scale
                continue
            history = self._history.setdefault(name, deque(maxlen=keep))
            if history and history[-1][0] >= record.step:
                continue
            history.append((record.step, math.log(value)))
            if len(history) == keep and name not in self._early:
                self._early[name] = max(v for _, v in history)
            if len(history) < 2 or history[-1][1] <= history[-2][1]:
                self._told.discard(name)  # the rise ended: a new one may be named
                continue
            judged = self._judge(history, keep, self._early.get(name))
            if judged is not None and name not in self._told:
                self._told.add(name)
                found.append((i, *judged))
        self._lr = {s: v for s, v in self._lr.items() if s >= record.step - 100 * keep}
        if not found or self.causes.named(LR_HIGH, record.step):  # a learning rate named too high explains it
            return []
        return [self._finding(record, found)]

    def _judge(self, history: deque[tuple[int, float]], keep: int,
               early: float | None) -> tuple[float, float, int, float] | None:
        """(from, to, from step, factor per step) when the history shows compounding growth, else None."""
        if len(history) < keep or early is None:
            return None
        points = list(history)
        recent = [b[1] - a[1] for a, b in zip(points[-self.patience - 1:-1], points[-self.patience:])]
        if min(recent) <= 0:
            return None  # not a rise on every one of the last ``patience`` measurements
        (s0, v0), (_, vm), (s1, v1) = points[0], points[self.patience], points[-1]
        grown = v1 - v0
        if grown < math.log(self.growth) or v1 - early < math.log(self.growth) or v1 - vm < COMPOUNDING * (vm - v0):
            return None  # not grown enough, or slowing down (saturating)
        lr0, lr1 = self._lr.get(s0), self._lr.get(s1)
        if lr0 is not None and lr1 is not None and lr1 > 1.01 * lr0:
            return None  # the learning rate rose over the window: a warmup's growth
        return math.exp(v0), math.exp(v1), s0, math.exp(grown / max(s1 - s0, 1))

    def _forget(self, name: str) -> None:
        self._history.pop(name, None)
        self._early.pop(name, None)
        self._told.discard(name)

    def _finding(self, record: StepRecord, found: list[tuple[int, float, float, int, float]]) -> Finding:
        layout = record.layout
        i, low, high, since, per_step = max(found, key=lambda f: f[2] / f[1])  # the one that grew most speaks
        names = [layout.layers[f[0]] for f in sorted(found)]
        types = sorted({layout.layer_types[f[0]] for f in found})
        factor, steps = high / low, record.step - since
        who = (f"the output of {_layer(layout.layers[i], layout.layer_types[i])}" if len(found) == 1 else
               f"the outputs of {len(found)} linear layers ({listed(names)}; {', '.join(types)})")
        grew = (f"{_layer(layout.layers[i])}'s from {low:.3g} at step {since} to {high:.3g} at step {record.step}"
                if len(found) > 1 else f"from {low:.3g} at step {since} to {high:.3g} at step {record.step}")
        message = (f"{who} grew on each of the last {plural(self.patience, 'sampled step')}, {grew} ({factor:.3g}x, "
                   f"{per_step ** 10:.3g}x per 10 steps) and not slowing down: compounding growth of linear layers' "
                   "outputs, Rybakov et al.'s precursor of divergence at a too-high learning rate; lower the "
                   "learning rate or normalise these outputs (qk-layernorm, QKV/Proj/FC2 norm).")
        data = {"layers": names[:20], "count": len(names), "from": low, "to": high, "from_step": since,
                "growth": factor, "per_step": per_step, "steps": steps, "hint": HINT}
        self._following.arm(record.step)
        finding = self.finding(record, "warning", names[0], message, value=factor, data=data)
        self._named = self._named or finding
        return finding

    def _followed(self, record: StepRecord) -> list[Finding]:
        """The error, once per episode: the loss follows the growth named."""
        named = self._named
        if named is None:
            return []
        follows = self._following.follows(record, self.causes)
        if follows is None:
            return []
        lowest, level = follows
        self._named, self._following = None, Following()  # the episode is told: a new rise starts another
        data = dict(named.data)
        data.update(named_at=named.step, loss_lowest=lowest, loss_level=level)
        loss = (f"the loss turned {level} at step {record.step}" if not math.isfinite(level) else
                f"the loss's level rose to {level:.4g} at step {record.step}, {level / lowest:.3g}x its lowest "
                f"({lowest:.4g}) since")
        message = (f"the loss follows the output growth named at step {named.step} ({listed(data['layers'])}, "
                   f"{data['growth']:.3g}x): {loss}. The run is diverging: lower the learning rate (or normalise "
                   "these outputs) and restart from before the growth began.")
        return [self.finding(record, "error", named.layer, message, value=level if math.isfinite(level) else None,
                             data=data)]

