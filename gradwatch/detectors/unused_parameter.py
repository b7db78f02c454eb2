"""Detector ``unused_parameter``: a parameter that requires grad never receives one."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, Layout, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "the parameter is not on the path to the loss: a submodule forward never calls, a .detach() "
    "or torch.no_grad() that cuts the graph, or a branch that is never taken; freeze it "
    "(requires_grad_(False)) if that is intended"
)


@dataclass
class UnusedParameter(Detector):
    """Parameters that require grad and received no gradient in the first ``patience`` steps
    of a layout.

    One root cause, one finding: the layers that own them are grouped by where they sit in the
    model. A module all of whose parameter-owning layers are unused (two or more) is reported
    once under its own path (a submodule that forward never calls); unused layers side by side in
    one module that has used ones too are one finding under that module (a dropped branch, e.g. a
    residual block whose forward forgot ``out += ...``); a lone unused layer is reported by name.

    Attributes:
        patience: steps without a gradient before it is reported.
    """

    kind = "unused_parameter"
    bounds = {"patience": Bound(1)}
    patience: int = 3
    _seen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Accumulate which parameters got a gradient; report the others at ``patience`` steps."""
        counts = record.vector("grad_nonfinite", PARAM)
        layout = record.layout
        if record.skipped or counts is None:
            return []
        if layout.version != self._version:
            self._seen, self._steps, self._version = np.zeros(len(layout.params), dtype=bool), 0, layout.version
        self._seen |= ~np.isnan(counts)
        self._steps += 1
        if self._steps != self.patience or not len(layout.trainable):
            return []
        unused = np.flatnonzero(~self._seen & np.asarray(layout.trainable, dtype=bool))
        by_layer: dict[str, list[str]] = {}
        for p in unused:
            by_layer.setdefault(layout.owner(int(p)), []).append(layout.params[p])
        out = []
        for where, layers in group(layout, list(by_layer)):
            params = [p for layer in layers for p in by_layer[layer]]
            numel = sum(layout.param_numel[layout.params.index(n)] for n in params)
            if len(layers) == 1:
                verb = "requires" if len(params) == 1 else "require"
                message = (f"{', '.join(_layer(p) for p in params)} ({plural(numel, 'element')}) {verb} grad but "
                           f"received no gradient in {plural(self.patience, 'step')}.")
            elif _owning(layout, where) == set(layers):
                message = (f"no parameter of {_layer(where)} ({', '.join(_short(where, x) for x in layers)}: "
                           f"{plural(len(params), 'parameter')}, {plural(numel, 'element')}) received a gradient in "
                           f"{plural(self.patience, 'step')} although they require grad: it is not on the path "
                           "to the loss.")
            else:
                message = (f"a branch of {_layer(where)} ({', '.join(_short(where, x) for x in layers)}: "
                           f"{plural(len(params), 'parameter')}, {plural(numel, 'element')}) received no gradient "
                           f"in {plural(self.patience, 'step')} although it requires grad: its output does not "
                           "reach the loss.")
            out.append(self.finding(record, "warning", where, message, value=float(len(params)),
                                    data={"parameters": params, "layers": layers, "hint": HINT}))
        return out


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _short(where: str, layer: str) -> str:
    return layer[len(where) + 1:] if layer.startswith(where + ".") else layer


def _owning(layout: Layout, prefix: str) -> set[str]:
    """The parameter-owning layers at or under a module path."""
    return {name for name, numel in zip(layout.layers, layout.layer_numel)
            if numel > 0 and (name == prefix or name.startswith(prefix + "."))}


def group(layout: Layout, layers: list[str]) -> list[tuple[str, list[str]]]:
    """Layers (module paths) grouped by where they sit: ``(module path, its layers)`` in model order.

    Two or more layers that are all the parameter-owning layers of a module become that module
    (repeatedly, upwards); two or more side by side in a module (not the model itself) become
    one group under it; any other layer is a group of its own. A layer (or module) that is the
    only parameter-owning part of its parent counts as that parent when siblings are compared
    (``block.down.conv`` sits beside ``block.conv1``).
    """
    def lift(path: str) -> str:
        own = _owning(layout, path)
        while _parent(path) and _owning(layout, _parent(path)) == own:
            path = _parent(path)
        return path

    groups: dict[str, tuple[str, list[str]]] = {lift(layer): (layer, [layer]) for layer in layers}
    while True:  # merge siblings that make up all of their module
        by_parent: dict[str, list[str]] = {}
        for anchor in groups:
            by_parent.setdefault(_parent(anchor), []).append(anchor)
        full = next(((parent, keys) for parent, keys in by_parent.items() if parent and len(keys) >= 2
                     and _owning(layout, parent) == {m for k in keys for m in groups[k][1]}), None)
        if full is None:
            break
        parent, keys = full
        groups[lift(parent)] = (parent, [m for k in keys for m in groups.pop(k)[1]])
    out: dict[str, list[str]] = {}
    for anchor, (name, members) in groups.items():
        parent = _parent(anchor)
        shared = bool(parent) and sum(_parent(a) == parent for a in groups) >= 2
        out.setdefault(parent if shared else name, []).extend(members)
    order = {name: i for i, name in enumerate(layout.layers)}
    return sorted(((k, sorted(v, key=order.__getitem__)) for k, v in out.items()), key=lambda kv: order[kv[1][0]])
