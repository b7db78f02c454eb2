"""Encoding: how every output writes a non-finite number (NaN, Inf), the one way, documented and stable.

A finding's numbers can be NaN or Inf — that is what gradwatch exists to find — and every output
must still write them: ``gradwatch check`` (text, json, junit, github), ``gradwatch ls --format
json``, the HTML report and its embedded data, the dashboard's API and live events,
``verdict.json``, Prometheus and TensorBoard.

**JSON is always strict** (no ``NaN``/``Infinity`` tokens; every writer uses ``allow_nan=False``,
so that a number that slipped past this module fails loudly instead of writing invalid JSON).
A non-finite number is written ``null`` and its string form — ``"nan"``, ``"inf"`` or ``"-inf"``
— is written beside it (docs/cli.md, "Non-finite numbers"):

- in an object, a field ``key`` holding a non-finite number is written ``"key": null`` with
  ``"key_nonfinite": "nan"`` beside it;
- in a list (under a field ``key``), each non-finite item is written ``null`` in place, and
  ``"key_nonfinite"`` beside the list maps each one's position to its string form:
  ``"values": [1.5, null], "values_nonfinite": {"1": "inf"}``; in lists of lists the position is
  the indices joined with ``/`` (``"0/2"``); objects inside a list carry their own ``_nonfinite``
  fields;
- a non-finite number under no field (a bare top-level value, an item of a top-level list) is
  ``null`` alone;
- series drawn as charts (the report's figures, the dashboard's curves, heatmaps and layer
  series) are ``null`` alone there: a gap in the line.

:func:`restore` reads that back to the numbers. Keys ending in ``_nonfinite`` are this scheme's.
Text for people writes the same string forms: ``nan``, ``inf``, ``-inf`` (:func:`text`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, overload

import numpy as np

#: suffix of the field written beside a field that holds non-finite numbers
SUFFIX = "_nonfinite"
#: the string forms of the non-finite numbers
FORMS = ("nan", "inf", "-inf")


def readable(value: str) -> str:
    """A string from the operating system (a path, a command line) as text that any output can write.

    With Python's UTF-8 mode off and the filesystem encoding ASCII (``LC_ALL=C``, ``PYTHONUTF8=0``), a
    path's non-ASCII bytes reach Python as lone surrogates (``surrogateescape``), which UTF-8 cannot
    encode: they are put back as the characters their bytes spell in UTF-8 (U+FFFD where they spell
    none). A string without them is returned as it is.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return value


def native(value: str) -> str:
    """The inverse of :func:`readable` for a name read back from a person or a client (a run's id in the
    dashboard's URL): the string the operating system's calls take for it, whatever the filesystem encoding.
    """
    return os.fsdecode(value.encode("utf-8", "surrogateescape"))


def nonfinite_text(value: Any) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite real number; None for anything else."""
    if isinstance(value, float | np.floating) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    return None


def text(value: Any) -> str:
    """A value for people: a non-finite number as ``nan``/``inf``/``-inf``, a number as Python writes it
    (``0.5``, ``3``), None as ``-``, anything else as ``str``.
    """
    form = nonfinite_text(value)
    if form is not None:
        return form
    if value is None:
        return "-"
    if isinstance(value, np.generic):
        return str(value.item())
    return str(value)


@overload
def whole(value: Any, default: int) -> int:
    ...


@overload
def whole(value: Any, default: None = None) -> int | None:
    ...


def whole(value: Any, default: int | None = None) -> int | None:
    """A data field read as a whole number (``repeats``, ``last_step``): ``default`` when it is not a
    finite number.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return default
    if isinstance(value, float | np.floating) and not math.isfinite(value):
        return default
    return int(value)


def _key(key: Any) -> str:
    """A mapping key as JSON writes it (a non-finite float key as its string form)."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    if isinstance(key, int | np.integer):
        return str(int(key))
    if isinstance(key, float | np.floating):
        return nonfinite_text(key) or repr(float(key))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _walk(value: Any, default: Callable[[Any], Any] | None, beside: bool, keep: bool) -> tuple[Any, Any]:
    """(``value`` made JSON-safe, its non-finite forms): the forms are a string for a non-finite
    number, a ``{position: form}`` dict for a list holding some, else None.
    """
    if value is None or isinstance(value, str | bool):
        return value, None
    if isinstance(value, np.bool_):
        return bool(value), None
    if isinstance(value, int | np.integer):
        return int(value), None
    if isinstance(value, float | np.floating):
        form = nonfinite_text(value)
        return (float(value), None) if form is None else (None, form)
    if isinstance(value, Mapping):
        walked = [(_key(k), *_walk(v, default, beside, keep)) for k, v in value.items()]
        siblings = {key + SUFFIX for key, _, forms in walked if forms and beside}
        out: dict[str, Any] = {}
        for key, safe, forms in walked:
            if key in siblings:
                continue  # the scheme's field wins over a same-named field of the value
            out[key] = safe
            if forms and beside:
                out[key + SUFFIX] = forms  # right beside the field
        return out, None
    if isinstance(value, list | tuple):
        items: list[Any] = []
        found: dict[str, str] = {}
        for i, v in enumerate(value):
            safe, forms = _walk(v, default, beside, keep)
            items.append(safe)
            if isinstance(forms, str):
                found[str(i)] = forms
            elif isinstance(forms, dict):
                found.update({f"{i}/{pos}": form for pos, form in forms.items()})
        return items, found or None
    if keep:  # left to the JSON encoder class
        return value, None
    if isinstance(value, np.ndarray):
        return _walk(value.tolist(), default, beside, keep)
    if default is not None:
        plain = default(value)
        if plain is not value:
            return _walk(plain, default, beside, keep)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def strict(value: Any, *, default: Callable[[Any], Any] | None = None, beside: bool = True) -> Any:
    """``value`` with every non-finite number written the documented way (see the module's doc):
    plain dicts, lists, strings, numbers, booleans and None that strict JSON can hold.

    Args:
        value: what to write (a finding, a record, an API response).
        default: called on an object JSON cannot hold, as :func:`json.dumps`'s ``default``; without
            it, such an object raises TypeError (numpy arrays are written as lists).
        beside: write the ``_nonfinite`` fields (False: a non-finite number is ``null`` alone, as
            chart data is).
    """
    return _walk(value, default, beside, False)[0]


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, beside: bool = True,
          cls: type[json.JSONEncoder] | None = None, **kwargs: Any) -> str:
    """Strict JSON text of ``value`` (:func:`strict`, then :func:`json.dumps` with ``allow_nan=False``).

    ``cls`` is a :class:`json.JSONEncoder` that writes the objects plain JSON cannot hold (the
    report passes plotly's, whose numpy arrays travel as typed arrays); ``kwargs`` go to
    :func:`json.dumps`.
    """
    if cls is not None:
        return json.dumps(_walk(value, None, beside, True)[0], cls=cls, allow_nan=False, **kwargs)
    return json.dumps(strict(value, default=default, beside=beside), allow_nan=False, **kwargs)


def restore(value: Any) -> Any:
    """JSON written by this scheme read back: every ``null`` with a ``_nonfinite`` form beside it is the
    number again (``float("nan")``, ``inf``, ``-inf``) and the ``_nonfinite`` fields are gone.
    """
    if isinstance(value, list):
        return [restore(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: restore(v) for k, v in value.items()}
    for key, forms in value.items():
        base = key[: -len(SUFFIX)] if key.endswith(SUFFIX) else None
        if base is None or base not in out:
            continue
        if isinstance(forms, str) and forms in FORMS and out[base] is None:
            out[base] = float(forms)
            del out[key]
        elif isinstance(forms, dict) and isinstance(out[base], list) and _put_all(out[base], forms):
            del out[key]
    return out


def _put_all(items: list[Any], forms: dict[str, Any]) -> bool:
    """Put each ``{position: form}`` back into ``items``; False (nothing changed) when one does not fit."""
    places = []
    for pos, form in forms.items():
        if form not in FORMS:
            return False
        *outer, last = pos.split("/")
        target: Any = items
        try:
            for index in outer:
                target = target[int(index)]
            if not isinstance(target, list) or target[int(last)] is not None:
                return False
        except (ValueError, IndexError, TypeError):
            return False
        places.append((target, int(last), float(form)))
    for target, i, number in places:
        target[i] = number
    return True


__all__ = ["FORMS", "SUFFIX", "dumps", "nonfinite_text", "restore", "strict", "text", "whole"]
