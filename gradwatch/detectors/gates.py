"""Gates (judging stage, for ``vanishing``): the parameters that scale the gradients beside them down by design."""

from __future__ import annotations

import numpy as np

from gradwatch.store.records import ROOT, Layout

#: a parameter whose values' RMS is at most this when watching begins scales the gradients of the layers
#: beside it down by design (a layer scale initialised at 1e-6 or 1e-5, ReZero's and SkipInit's 0, a
#: residual branch's last BatchNorm weight initialised at 0); so long as it stays this small
GATE = 1e-3

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
