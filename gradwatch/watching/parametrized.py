"""Parametrized modules (base): the modules that compute a parametrized module's weights are no layers of their own.

``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, a
``torch.ao.pruning`` sparsifier's mask, any ``register_parametrization``) moves a module's ``weight`` to
``module.parametrizations.weight.original`` and computes the weight each time it is read, by calling the
modules of that list. Their outputs are weights, not activations; their parameters (the originals) are the
parametrized module's; a NaN/Inf born in them was born in the parametrized module.
"""

from __future__ import annotations

from torch import nn


def computing(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """The modules that compute a parametrized module's tensors, by id: its ``parametrizations`` container,
    the lists in it and every module in those, each mapped to the parametrized module's path ("" for the
    model itself) and the parametrized module.
    """
    found: dict[int, tuple[str, nn.Module]] = {}
    for path, module in model.named_modules():
        container = _container(module)
        if id(module) not in found and container is not None:
            for inner in container.modules():
                found.setdefault(id(inner), (path, module))
    return found


def is_leaf(module: nn.Module, inside: dict[int, tuple[str, nn.Module]]) -> bool:
    """Whether ``module``'s output is an activation of its own: it has no children, or only its
    ``parametrizations`` (a parametrized ``Linear``), and it does not compute another module's weight.
    """
    return id(module) not in inside and all(id(child) in inside for child in module.children())


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """A module's own parameters, and for a parametrized module those of its parametrizations (the originals)."""
    own = list(module.parameters(recurse=False))
    container = _container(module)
    if container is not None:
        own += container.parameters()
    return own


def _container(module: nn.Module) -> nn.Module | None:
    """A parametrized module's ``parametrizations`` (a ``ModuleDict`` holding at least one list), else None.

    Read from the module's own children, as ``register_parametrization`` sets it: not through attribute
    lookup, which a wrapper that forwards attributes (PEFT's LoRA layer to its base layer) would answer
    with the wrapped module's.
    """
    found = module._modules.get("parametrizations")
    return found if isinstance(found, nn.ModuleDict) and len(found) > 0 else None


def layers_of(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """Every module of ``model``, by id: the path and the module of the layer it is part of, that is itself,
    or the parametrized module whose weight it computes (a NaN/Inf born there is named after that layer).
    """
    inside = computing(model)
    return {id(m): inside.get(id(m), (path, m)) for path, m in model.named_modules()}
