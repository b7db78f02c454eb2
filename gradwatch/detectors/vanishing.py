"""Detector ``vanishing``: a layer's gradient is negligible, absolutely or relative to the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.detectors.base import median as _median
from gradwatch.detectors.causes import LR_HIGH
from gradwatch.detectors.collapse import Collapse
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, ROOT, Layout, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

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
#: a parameter whose values' RMS is at most this when watching begins scales the gradients of the layers
#: beside it down by design (a layer scale initialised at 1e-6 or 1e-5, ReZero's and SkipInit's 0, a
#: residual branch's last BatchNorm weight initialised at 0); so long as it stays this small
GATE = 1e-3
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

    Attributes:
        absolute: RMS below this is negligible whatever the other layers do.
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
        norm = record.vector("grad_norm")
        if record.skipped or norm is None:
            return []
        layout = record.layout
        if layout.version != self._version:  # counts carry over a new layout of the same layers (frozen, unfrozen)
            numel = np.asarray(layout.layer_numel, dtype=np.float64)
            if not layout.same_layers(self._layout):
                self._runs = np.zeros(len(layout.layers), dtype=np.int64)
                self._explained = np.zeros(len(layout.layers), dtype=np.int64)
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
        small = has & (rms < max(self.absolute, self.relative * median))
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
        for i in due[rms[due] > 0]:
            name, ratio = layout.layers[i], rms[i] / median
            below = (f"{ratio:.2g}x the median layer's {median:.3g}" if ratio < self.relative else
                     f"below the floor of {self.absolute:g} (the median layer's is {median:.3g})")
            message = (f"gradient of {_layer(name, layout.layer_types[i])} has vanished for "
                       f"{plural(self.patience, 'step')}: RMS {rms[i]:.3g}, {below}.")
            out.append(self.finding(record, "warning", name, message, value=float(ratio),
                                    data={"rms": float(rms[i]), "median_rms": median, "hint": HINT}))
        return out

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
            where = f" in '{scope}'" if scope is not None else ""
            first, least = layout.layers[named[0]], float(rms[named].min() / median)
            listed = ", ".join(repr(layout.layers[i]) for i in named[:3]) + (", ..." if len(named) > 3 else "")
            which = (f"the gradient of {_layer(first, layout.layer_types[named[0]])} has" if len(named) == 1 else
                     f"the gradients of {plural(len(named), 'layer')}{where} ({listed}) have")
            them = "it" if len(named) == 1 else "them"
            low = (f"down to {least:.2g}x the median layer's RMS" if least < self.relative else
                   f"RMS down to {float(rms[named].min()):.3g}, below the floor of {self.absolute:g}")
            message = (f"{which} been small for {plural(self.patience, 'step')} ({low}) because "
                       f"'{layout.params[p]}' scales {them} down: its RMS is "
                       f"{size:.3g}, small by design (a layer scale or a zero-initialised gate). Not judged as "
                       f"vanishing until it grows past {GATE:g}.")
            out.append(self.finding(record, "info", first, message, value=least,
                                    data={"gate": layout.params[p], "gate_rms": size,
                                          "layers": [layout.layers[i] for i in named][:20]}))
        return out


def trained(layout: Layout) -> np.ndarray:
    """Per layer, whether it owns a parameter that requires grad (a frozen layer's gradient, whatever its
    ``.grad`` holds, is no vanishing one); every layer where the layout does not say.
    """
    out = np.zeros(len(layout.layers), dtype=bool)
    if len(layout.trainable) != len(layout.params):
        out[:] = True
    for layer, p in layout.owners if not out.all() else ():
        out[layer] |= layout.trainable[p]
    return out


def _scope(layout: Layout, param: int, gated: frozenset[int] = frozenset()) -> str | None:
    """The module whose layers a gate parameter scales: its owner, or a leaf owner's parent, widened past
    modules that hold no layer with weights but gates (the ``nn.Sequential`` of DiT's adaLN modulation, the
    ``ModuleDict`` of PEFT's ``lora_B``, a ``ModuleList`` of ControlNet's zero convolutions); None at the root.
    ``gated``: the layers that own a gate.
    """
    owner = next((layer for layer, p in layout.owners if p == param), None)
    if owner is None:
        return None
    name = layout.layers[owner]
    if owner in layout.leaves:
        name = name.rpartition(".")[0] if "." in name else ROOT
    weighted = {layer for layer, _ in layout.owners} - gated
    while name != ROOT and not any(layout.layers[i].startswith(name + ".") for i in weighted):
        name = name.rpartition(".")[0] if "." in name else ROOT
    return None if name == ROOT else name


def _candidates(layout: Layout, sizes: np.ndarray) -> set[int]:
    """Trainable parameters, not biases, owned below the root, whose values' RMS is at most ``GATE``."""
    root = {p for layer, p in layout.owners if layout.layers[layer] == ROOT}
    return {p for p, name in enumerate(layout.params) if layout.trainable[p] and p not in root
            and not name.rpartition(".")[2].startswith("bias") and sizes[p] <= GATE}


def _scoped(layout: Layout, sizes: np.ndarray) -> dict[int, str | None]:
    """Each gate parameter (see ``_candidates``) and its scope (see ``_scope``), in parameter order."""
    found = _candidates(layout, sizes)
    gated = frozenset(layer for layer, q in layout.owners if q in found)
    return {p: _scope(layout, p, gated) for p in sorted(found)}


def gates(layout: Layout, sizes: np.ndarray, scoped: dict[int, str | None] | None = None) -> dict[int, np.ndarray]:
    """The parameters that scale the gradients of the layers beside them down (see ``GATE``): trainable,
    not a bias, owned below the root, values' RMS at most ``GATE``; each with the indices of those layers.
    ``scoped``: :func:`_scoped`'s answer, when the caller has it.
    """
    out: dict[int, np.ndarray] = {}
    for p, scope in (_scoped(layout, sizes) if scoped is None else scoped).items():
        if scope is None:
            continue
        own = {layer for layer, q in layout.owners if q == p}
        layers = [i for i, layer in enumerate(layout.layers) if layer.startswith(scope + ".") and i not in own]
        if layers:
            out[p] = np.asarray(layers, dtype=np.int64)
    return out


def outer(layout: Layout, sizes: np.ndarray, scoped: dict[int, str | None] | None = None) -> dict[int, np.ndarray]:
    """The gates of the whole model: gate parameters (see ``gates``) whose scope widens to the root, a leaf
    right under the root or a module holding nothing but gates (DiT's final layer: a zero-initialised
    Linear and its adaLN modulation; a zero-initialised head). Such a layer is the model's output layer
    or a branch's end beside it; each with the indices of the layers that own it. ``scoped``: as for
    :func:`gates`.
    """
    scoped = _scoped(layout, sizes) if scoped is None else scoped
    out: dict[int, list[int]] = {}
    for layer, p in layout.owners:
        if p in scoped and scoped[p] is None:
            out.setdefault(p, []).append(layer)
    return {p: np.asarray(layers, dtype=np.int64) for p, layers in sorted(out.items())}
