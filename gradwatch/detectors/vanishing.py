"""Detector ``vanishing``: a layer's gradient is negligible, absolutely or relative to the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.base import median as _median
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.detectors.collapse import Collapse
from gradwatch.detectors.gates import GATE, _scoped, gates, outer, trained
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, Layout, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import listed, plural

HINT = (
    "use a non-saturating activation (ReLU/GELU) instead of sigmoid/tanh in deep stacks, a scaled "
    "initialisation (He/Xavier), normalisation layers or residual connections"
)
HINT_ZERO = (
    "something after this layer passes no gradient back: a ReLU (often a functional F.relu) that zeroes "
    "all of its outputs, a multiplication by zero, a mask, or a .detach() on one of two paths"
)
#: a leaf with at least this fraction of exactly-zero outputs is dead (as ``dead_units`` judges it)
DEAD = 0.99
#: a layer whose latest measured update moved its weights by at least this fraction of their norm learns: a
#: gradient below the absolute floor is then small by the loss's scale (a loss multiplied by 1e-30 and a
#: learning rate by 1e30, weights stored in units of 1e-19), not a vanishing one
LEARNS = 1e-6
#: a small layer under a gate is explained by it while its RMS, relative to the median layer's, is at
#: least this times the gate's RMS (its gradient is the gate times an ordinary one)
EXPLAINED = 1e-2


@dataclass
class Vanishing(Detector):
    """A layer whose gradient RMS (norm / sqrt(numel)) stays below ``absolute``, or below
    ``relative`` times the median RMS of the layers, for ``patience`` steps in a row.

    One root cause, one finding: layers whose gradients are exactly zero (not small: no gradient
    flows back to them) are one finding, at the last of them in model order (the cut is after
    it); a gradient that is exactly zero while a leaf of the model is dead (its outputs all zero
    on the latest sampled step) is a consequence that ``dead_units`` reports, and so is any
    small gradient within 100 steps of a too-high learning rate named by another detector (it
    saturates and kills units); a step whose gradients are all exactly zero is ``zero_gradient``'s, and one whose
    gradient norm overflows is ``exploding``'s. A frozen layer (none of its parameters requires grad in the
    record's layout) is not judged, whatever its ``.grad`` holds (zeros kept by ``zero_grad(set_to_none=False)``);
    a layer whose parameters were renewed (a head replaced) starts its count anew, and the collapse its early size.

    Small by design is not vanishing: a trainable parameter (not a bias) whose values' RMS is at most
    ``GATE`` on the first sampled step (a layer scale at 1e-6, a ReZero gate at 0, a residual block's last
    BatchNorm weight at 0) multiplies the gradients of the layers of its module (of its parent module when
    it is a leaf's: timm's ``LayerScale``) by its own size. While it stays that small, a layer there whose
    RMS is at least ``EXPLAINED`` times the gate's is not counted; should one stay small for ``patience``
    steps, one finding of severity info per gate says so. Grown past ``GATE``, the gate explains nothing.

    The absolute floor is a floor on learning, not on a number: a layer below it whose latest measured update
    ratio is at least ``LEARNS`` (1e-6) still learns — its gradient is small by the loss's scale, which the
    learning rate makes up for — and is not counted; the relative bound is judged as ever.

    Attributes:
        absolute: RMS below this is negligible whatever the other layers do (unless the layer's updates
            show that it learns).
        relative: RMS below this fraction of the median layer's RMS is negligible.
        patience: consecutive steps (with a gradient) before it is reported.
        collapse: the whole model's gradients collapsed when the median layer's RMS is below this
            fraction of its first steps' while the loss has stalled (see
            :class:`~gradwatch.detectors.collapse.Collapse`); 0 turns it off.
    """

    kind = "vanishing"
    bounds = {"relative": Bound(0, 1), "patience": Bound(1), "collapse": Bound(0, 1)}
    absolute: float = 1e-10
    relative: float = 1e-4
    patience: int = 10
    collapse: float = 1e-2
    _collapse: Collapse = field(default_factory=Collapse, init=False, repr=False)
    _runs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)
    _layout: Layout | None = field(default=None, init=False, repr=False)  # the layout of the latest version
    _scale: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False, repr=False)  # 1/sqrt(numel)
    _sized: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)
    _dead: bool = field(default=False, init=False, repr=False)  # a leaf was dead on the latest sampled step
    _counting: bool = field(default=False, init=False, repr=False)  # some layer's count is above 0
    #: per layer: its latest measured update ratio was at least LEARNS
    _learning: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)
    _previous: StepRecord | None = field(default=None, init=False, repr=False)  # the step judged last
    #: per gate parameter (index), the layers it scales and its RMS on the latest sampled step (see GATE)
    _gates: dict[int, tuple[np.ndarray, float]] | None = field(default=None, init=False, repr=False)
    #: the gates of the whole model (a zero-initialised output layer, see ``outer``): per gate parameter,
    #: the layers that own it
    _outer: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _scopes: dict[int, str | None] = field(default_factory=dict, init=False, repr=False)  # per gate (see _scope)
    _explained: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)
    _told: set[int] = field(default_factory=set, init=False, repr=False)  # the gates an info finding named

    def check(self, record: StepRecord) -> list[Finding]:
        """Count consecutive negligible steps per layer; report a layer when it reaches patience (and a
        model whose gradients collapsed while its loss stalled: :class:`~gradwatch.detectors.collapse.Collapse`).
        """
        previous, self._previous = self._previous, record
        if previous is not None:
            self._learned(previous)
        norm = record.vector("grad_norm")
        if record.skipped or norm is None:
            return []
        layout = record.layout
        if layout.version != self._version:  # counts carry over a new layout of the same layers (frozen, unfrozen)
            numel = np.asarray(layout.layer_numel, dtype=np.float64)
            if not layout.same_layers(self._layout):
                self._runs = np.zeros(len(layout.layers), dtype=np.int64)
                self._explained = np.zeros(len(layout.layers), dtype=np.int64)
                self._learning = np.zeros(len(layout.layers), dtype=bool)
            self._version, self._layout, self._gates = layout.version, layout, None
            self._scale, self._sized = 1.0 / np.sqrt(np.maximum(numel, 1.0)), (numel > 0) & trained(layout)
            restart = ~self._sized  # frozen, or (renewed) other parameters than the counts were of: anew
            restart[list(layout.renewed)] = True
            self._runs[restart], self._explained[restart] = 0, 0
            if layout.renewed and self._collapse.early:  # the early gradient size was another model's
                self._collapse = Collapse()
        finite = record.gradients_finite()  # then so is every layer's norm
        if not finite:
            bad = record.vector("grad_nonfinite")
            if bad is not None and (bad > 0).any():
                return []  # a non-finite step is the nonfinite detector's
        zeros = record.vector("act_zero_frac")
        if zeros is not None:
            self._dead = bool((zeros >= DEAD).any())  # NaN (leaf not called) compares False
        weights = record.vector("param_norm", PARAM)
        if weights is not None:
            self._gate_sizes(layout, weights)
        rms = norm.astype(np.float64) * self._scale
        if not finite and np.isinf(rms).any():
            return []  # an overflowing gradient norm is the exploding detector's
        has = np.isfinite(rms) & self._sized
        said = self._collapse.check(record, rms, has, self.collapse, dead=self._dead, causes=self.causes) \
            if self.collapse > 0 else None
        collapsed = [self.finding(record, "warning", None, said[0], value=said[1], data=said[2])] if said else []
        measured = rms[has]
        if len(measured):
            low = measured.min()
            # the median is at most the largest: a smallest RMS above both bounds leaves nothing small
            if low > 0 and low >= max(self.absolute, self.relative * measured.max()):
                self._reset(has)
                return collapsed
        positive = rms[has & (rms > 0)]
        if not len(positive):
            self._runs[:] = 0  # every gradient exactly zero: the zero_gradient detector's
            return collapsed
        median = _median(positive)
        small = has & ((rms < self.relative * median) | ((rms < self.absolute) & (~self._learning | (rms == 0))))
        if self.causes.named(LR_HIGH, record.step):
            small[:] = False  # a too-high learning rate saturates and kills units: its consequences
        elif self._dead:
            small &= rms > 0  # exactly zero behind dead units: their consequence
        if not small.any():  # the usual step: every count is reset where there is a gradient
            self._reset(has)
            return collapsed
        explained = self._by_gates(small, rms, median)
        small &= ~explained
        self._runs = np.where(small, self._runs + 1, self._runs * ~has)  # a layer without a gradient keeps its count
        self._explained = np.where(explained, self._explained + 1, self._explained * ~has)
        self._counting = True
        out = collapsed + self._small_by_design(record, explained, rms, median)
        due = np.flatnonzero(small & (self._runs == self.patience))
        zero = due[rms[due] == 0]
        if len(zero):  # one cut in the graph, one finding: at the last of them in model order
            i = int(zero[-1])
            names = [layout.layers[k] for k in zero]
            name, others = names[-1], len(names) - 1
            more = f" (and {plural(others, 'layer')} before it)" if others else ""
            message = (f"gradient of {_layer(name, layout.layer_types[i])}{more} has been exactly zero for "
                       f"{plural(self.patience, 'step')} while the median layer's RMS is {median:.3g}: no gradient "
                       "flows back past it.")
            out.append(self.finding(record, "warning", name, message, value=0.0,
                                    data={"rms": 0.0, "median_rms": median, "count": len(names),
                                          # from the cut backwards: the nearest 19 and the first (the input end)
                                          "layers": names[::-1] if len(names) <= 20 else [*names[:-20:-1], names[0]],
                                          "hint": HINT_ZERO}))
        small_due = due[rms[due] > 0]
        if len(small_due):  # one cause at one step (a deep stack, one initialisation): one finding for them all
            out.append(self._vanished(record, small_due, rms, median))
        return out

    def _vanished(self, record: StepRecord, due: np.ndarray, rms: np.ndarray, median: float) -> Finding:
        """One finding for the layers whose small gradient reached ``patience`` at this step: its layer the
        first in model order, its value the smallest ratio to the median; ``data["layers"]`` and
        ``data["rms"]`` name them all (up to 20) when there are several.
        """
        layout = record.layout
        names, ratios = [layout.layers[i] for i in due], rms[due] / median
        least = int(np.argmin(ratios))
        ratio = float(ratios[least])
        below = (f"{ratio:.2g}x the median layer's {median:.3g}" if ratio < self.relative else
                 f"below the floor of {self.absolute:g} (the median layer's is {median:.3g})")
        data: dict[str, object] = {"rms": float(rms[due[least]]), "median_rms": median, "hint": HINT}
        if len(names) == 1:
            message = (f"gradient of {_layer(names[0], layout.layer_types[due[0]])} has vanished for "
                       f"{plural(self.patience, 'step')}: RMS {rms[due[0]]:.3g}, {below}.")
        else:
            types = ", ".join(sorted({layout.layer_types[i] for i in due}))
            message = (f"gradients of {len(names)} layers ({listed(names)}; {types}) have vanished for "
                       f"{plural(self.patience, 'step')}: RMS {rms[due].min():.3g} to {rms[due].max():.3g}, the "
                       f"smallest {below}.")
            data.update(layers=names[:20], rms_layers=[float(r) for r in rms[due][:20]], count=len(names))
        return self.finding(record, "warning", names[0], message, value=ratio, data=data)

    def _learned(self, record: StepRecord) -> None:
        """Note which layers the previous step's update moved (its update ratio is known one step late: live,
        by the time this step is judged; offline, stored with it), so that live and re-judged runs agree.
        """
        updates = record.vector("update_ratio")
        if updates is not None and record.layout.same_layers(self._layout) and len(updates) == len(self._learning):
            self._learning = np.where(np.isfinite(updates), updates >= LEARNS, self._learning)

    def _reset(self, has: np.ndarray) -> None:
        """Nothing is small: every count is reset where there is a gradient."""
        if self._counting:
            self._runs = self._runs * ~has
            self._explained = self._explained * ~has
            self._counting = bool(self._runs.any() or self._explained.any())

    def _gate_sizes(self, layout: Layout, weights: np.ndarray) -> None:
        """Find the layout's gates on its first sampled step (see GATE), then follow their sizes."""
        numel = np.maximum(np.asarray(layout.param_numel, dtype=np.float64), 1.0)
        sizes = weights.astype(np.float64) / np.sqrt(numel)
        if self._gates is None:
            self._scopes = _scoped(layout, sizes)
            self._gates = {p: (layers, float(sizes[p])) for p, layers in gates(layout, sizes, self._scopes).items()}
            self._outer = outer(layout, sizes, self._scopes)
            every = np.arange(len(layout.layers))
            self._gates.update({p: (np.setdiff1d(every, own), float(sizes[p])) for p, own in self._outer.items()})
        else:
            self._gates = {p: (layers, float(sizes[p])) for p, (layers, _) in self._gates.items()}

    def _by_gates(self, small: np.ndarray, rms: np.ndarray, median: float) -> np.ndarray:
        """The small layers that a gate still small scales down by as much as they are small.

        A gate of the whole model (``outer``) scales every layer alike, so it explains no layer small beside
        the others; only those below the absolute floor with the median (every layer is), and only while
        its own layer's gradient is above the floor (a zero output layer's is ordinary: a network whose
        gradients all vanish, that layer's too, is vanishing).
        """
        explained = np.zeros(len(small), dtype=bool)
        ratio = rms / median
        for p, (layers, size) in (self._gates or {}).items():
            if not size <= GATE:  # NaN (not measured) compares False
                continue
            own = self._outer.get(p)
            if own is None:
                explained[layers] |= ratio[layers] >= EXPLAINED * size
            elif len(own) and (rms[own] >= self.absolute).all():
                floor = EXPLAINED * size * self.absolute  # the gate's size accounts for the shortfall
                explained[layers] |= (ratio[layers] >= self.relative) & (rms[layers] >= floor)
        return explained & small

    def _small_by_design(self, record: StepRecord, explained: np.ndarray, rms: np.ndarray,
                         median: float) -> list[Finding]:
        """One info finding per gate whose layers have been small for ``patience`` steps (said once)."""
        due = explained & (self._explained == self.patience)
        out: list[Finding] = []
        if not due.any():
            return out
        layout = record.layout
        for p, (layers, size) in (self._gates or {}).items():
            named = [int(i) for i in layers if due[i]]
            if p in self._told or not named or not size <= GATE:
                continue
            self._told.add(p)
            scope = self._scopes.get(p)  # the module whose layers it was found to scale
            where = f" in {_layer(scope)}" if scope is not None else ""
            first, least = layout.layers[named[0]], float(rms[named].min() / median)
            listed = ", ".join(_layer(layout.layers[i]) for i in named[:3]) + (", ..." if len(named) > 3 else "")
            which = (f"the gradient of {_layer(first, layout.layer_types[named[0]])} has" if len(named) == 1 else
                     f"the gradients of {plural(len(named), 'layer')}{where} ({listed}) have")
            them = "it" if len(named) == 1 else "them"
            low = (f"down to {least:.2g}x the median layer's RMS" if least < self.relative else
                   f"RMS down to {float(rms[named].min()):.3g}, below the floor of {self.absolute:g}")
            message = (f"{which} been small for {plural(self.patience, 'step')} ({low}) because "
                       f"{_layer(layout.params[p])} scales {them} down: its RMS is "
                       f"{size:.3g}, small by design (a layer scale or a zero-initialised gate). Not judged as "
                       f"vanishing until it grows past {GATE:g}.")
            out.append(self.finding(record, "info", first, message, value=least,
                                    data={"gate": layout.params[p], "gate_rms": size,
                                          "layers": [layout.layers[i] for i in named][:20]}))
        return out
