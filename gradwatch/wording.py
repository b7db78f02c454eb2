"""Wording: how counts and layer names read inside the sentences gradwatch writes (findings, doctor, CLI)."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun in the right number: ``1 layer``, ``2 layers``, ``1,024 elements``.

    Args:
        n: how many.
        noun: the singular.
        nouns: the plural when it is not ``noun + "s"``.
    """
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"


def layer(name: str | None, type_: str | None = None) -> str:
    """A layer (or parameter) as it reads in a sentence: its module path, with its type if given.

    A path that starts with an index, as ``nn.Sequential`` names its children (``0``,
    ``3.weight``), is quoted so that it does not read as a number: ``'0' (Linear)``, but
    ``encoder.layers.3.linear1 (Linear)``. None (a global finding) reads ``the model``.
    """
    if name is None:
        text = "the model"
    elif name.split(".", 1)[0].isdigit():
        text = f"'{name}'"
    else:
        text = name
    return f"{text} ({type_})" if type_ else text


#: where a NaN/Inf born outside the model's layers is placed (origin tracking's ``source``)
SOURCES = {"input": "the input batch", "loss": "the loss"}


def place(name: str | None, phase: str | None = None, source: str | None = None) -> str:
    """Where a finding is, as ``check``, the report and the dashboard all say it: the layer, with its
    phase if any (``fc1 (backward)``); a layer-less NaN/Inf born in the input batch or the loss there
    (``the input batch``); any other finding of no layer ``global`` (``global (forward)``).
    """
    if name is None and source in SOURCES:
        return SOURCES[source]
    where = name if name is not None else "global"
    return f"{where} ({phase})" if phase else where


#: layers a grouped finding's message names one by one at most (beyond: the first three ... the last two)
SHOWN = 6


def listed(names: list[str]) -> str:
    """``fc1, fc2, fc3`` (``'0', '2', '4'``: each as :func:`layer` writes it), or for more than :data:`SHOWN`
    layers ``'0', '2', '4' … '16', '18'``: the layers one finding covers (one cause at one step), in model order.
    """
    quoted = [layer(n) for n in names]
    if len(quoted) <= SHOWN:
        return ", ".join(quoted)
    return ", ".join(quoted[:3]) + " … " + ", ".join(quoted[-2:])
