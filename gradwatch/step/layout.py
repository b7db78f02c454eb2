"""Layout: discovers a model's layers and parameters, in model order, with stable names."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from gradwatch.errors import ConfigError
from gradwatch.store.records import ROOT, Layout
from gradwatch.watching.parametrized import computing, is_leaf, own_parameters

#: output bounds of activations that saturate
_BOUNDED: dict[type[nn.Module], tuple[float, float]] = {
    nn.Sigmoid: (0.0, 1.0),
    nn.Tanh: (-1.0, 1.0),
    nn.Hardsigmoid: (0.0, 1.0),
    nn.Softsign: (-1.0, 1.0),
}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile`` / DistributedDataParallel / DataParallel wrappers."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        else:
            return model
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def bounds(module: nn.Module) -> tuple[float, float] | None:
    """Output bounds of a saturating activation module, else None."""
    if isinstance(module, nn.Hardtanh):  # also ReLU6
        return (float(module.min_val), float(module.max_val))
    for cls, b in _BOUNDED.items():
        if isinstance(module, cls):
            return b
    return None


_EPS: dict[torch.dtype, float] = {}


def eps(dtype: torch.dtype) -> float:
    """The machine epsilon the layout keeps for a parameter of ``dtype`` (0 where it is not floating point)."""
    found = _EPS.get(dtype)
    if found is None:
        found = _EPS[dtype] = float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0
    return found


@dataclass
class Discovered:
    """A layout plus the torch objects its indices refer to."""

    layout: Layout
    params: list[nn.Parameter]
    leaf_modules: list[tuple[int, nn.Module]]
    #: every module of the model when discovered (a registration into one changes the layout), held weakly:
    #: the watcher never keeps the model alive
    modules: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)


def discover(model: nn.Module, version: int) -> Discovered:
    """Enumerate layers (modules owning parameters, and leaves) and parameters of a model.

    A parametrized module (``torch.nn.utils.parametrize``) is one layer that owns its parametrizations'
    parameters, and a leaf when they are its only children; the modules that compute its weight are no layers.

    Raises:
        ConfigError: the model has no parameter that requires a gradient.
    """
    inner = unwrap(model)
    params: list[nn.Parameter] = []
    pnames: list[str] = []
    index: dict[int, int] = {}
    for name, p in inner.named_parameters():
        index[id(p)] = len(params)
        params.append(p)
        pnames.append(name)
    if not any(p.requires_grad for p in params):
        what = "no parameters" if not params else "no parameter that requires grad (all are frozen)"
        raise ConfigError(
            f"{type(inner).__name__} has {what}; gradwatch watches gradients, so give gw.watch a model "
            "with trainable parameters"
        )
    layers: list[str] = []
    types: list[str] = []
    numel: list[int] = []
    leaves: list[int] = []
    saturating: list[int] = []
    owners: list[tuple[int, int]] = []
    leaf_modules: list[tuple[int, nn.Module]] = []
    inside = computing(inner)
    modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    for name, module in inner.named_modules():
        modules.add(module)
        if id(module) in inside:
            continue  # computes a parametrized module's weight: its parameters are that module's
        own = [index[id(p)] for p in own_parameters(module) if id(p) in index]
        leaf = is_leaf(module, inside)
        if not own and not leaf:
            continue
        i = len(layers)
        layers.append(name or ROOT)
        types.append(type(module).__name__)
        numel.append(sum(params[j].numel() for j in set(own)))
        owners.extend((i, j) for j in dict.fromkeys(own))
        if leaf:
            leaves.append(i)
            leaf_modules.append((i, module))
            if bounds(module) is not None:
                saturating.append(i)
    layout = Layout(
        version=version,
        layers=tuple(layers),
        layer_types=tuple(types),
        layer_numel=tuple(numel),
        params=tuple(pnames),
        param_numel=tuple(p.numel() for p in params),
        owners=tuple(owners),
        leaves=tuple(leaves),
        saturating=tuple(saturating),
        trainable=tuple(p.requires_grad for p in params),
        eps=tuple(eps(p.dtype) for p in params),
    )
    return Discovered(layout, params, leaf_modules, modules)


def retrained(found: Discovered, trainable: tuple[bool, ...]) -> Discovered:
    """``found`` as a new layout version where only which parameters require grad changed (the same
    layers, parameters and indices: vectors measured with ``found`` fit it).
    """
    layout = replace(found.layout, version=found.layout.version + 1, trainable=trainable, renewed=())
    return Discovered(layout, found.params, found.leaf_modules, found.modules)

