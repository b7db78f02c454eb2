"""Unregistered layers: a model with nothing to train whose modules sit in a plain list, dict or tuple."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradwatch.errors import ConfigError

#: the attributes every module has of its own (its hook and parameter dicts): never the user's
_OWN = frozenset(vars(nn.Module()))
#: containers named in a refusal at most
NAMED = 3


def _held(value: Any) -> tuple[str, list[Any]] | None:
    """The kind of plain container ``value`` is and its items (None when it is none)."""
    if isinstance(value, dict):
        return "dict", list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value).__name__, list(value)
    return None


def unregistered(model: nn.Module) -> list[dict[str, Any]]:
    """The attributes of the model's modules that hold modules or trainable tensors in a plain Python
    container, which ``nn.Module`` does not register: ``path`` (``Net.layers``), ``container`` (``list``),
    ``modules`` (their count and class names) and ``tensors`` (trainable tensors held the same way).
    """
    found = []
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            held = _held(value) if attr not in _OWN else None
            if held is None:
                continue
            kind, items = held
            modules = [v for v in items if isinstance(v, nn.Module)]
            tensors = [v for v in items if isinstance(v, torch.Tensor) and v.requires_grad]
            if modules or tensors:
                owner = f"{type(model).__name__}.{path}" if path else type(model).__name__
                found.append({"path": f"{owner}.{attr}", "container": kind, "modules": len(modules),
                              "classes": sorted({type(m).__name__ for m in modules}), "tensors": len(tensors),
                              "attr": attr})
    return found


def refuse(model: nn.Module) -> None:
    """Refuse a model with no trainable parameter whose layers sit in a plain container, saying so.

    Raises:
        ConfigError: naming each such attribute and what would register its contents (``nn.ModuleList``,
            ``nn.ModuleDict``, ``nn.ParameterList``), or how to watch each layer instead.
    """
    if any(p.requires_grad for p in model.parameters()):
        return
    found = unregistered(model)
    if not found:
        return
    parts = []
    for one in found[:NAMED]:
        what = []
        if one["modules"]:
            what.append(f"{one['modules']} {', '.join(one['classes'])} module{'s' if one['modules'] > 1 else ''}")
        if one["tensors"]:
            what.append(f"{one['tensors']} trainable tensor{'s' if one['tensors'] > 1 else ''}")
        kind = ("Module" if one["modules"] else "Parameter") + ("Dict" if one["container"] == "dict" else "List")
        parts.append(f"{one['path']} is a plain {one['container']} of {' and '.join(what)}, which nn.Module does not "
                     f"register (nn.{kind} would: self.{one['attr']} = nn.{kind}(...))")
    more = f"; and {len(found) - NAMED} more" if len(found) > NAMED else ""
    first = found[0]
    each = (f", or watch each layer into its own run (for i, layer in enumerate(model.{first['attr']}): "
            f"gw.watch(layer, run=f'runs/layer{{i}}'))") if first["modules"] and first["container"] != "dict" else ""
    raise ConfigError(
        f"{type(model).__name__} has no parameters: {'; '.join(parts)}{more}. Their parameters are not the model's, "
        f"so gradwatch has nothing to watch; register them and gw.watch(model) watches them all{each}"
    )
