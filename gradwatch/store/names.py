"""Store names: the metrics and layers a run holds, and the check that names asked of the reader exist."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gradwatch.store.records import ACT_METRICS, GRAD_METRICS, LAYER, PARAM, PRECLIP

#: global scalars gradwatch itself records (observed ones such as ``acc`` are the run's own)
KNOWN_SCALARS = ("grad_norm", "loss", "lr", PRECLIP)
#: per-layer and per-parameter metrics gradwatch measures (a run may lack some: no activations ...)
KNOWN_VECTORS = (*GRAD_METRICS, *ACT_METRICS)
#: most valid names an error message lists before it says how many more there are
LISTED = 30

Query = Callable[[str, Iterable[Any]], list[tuple[Any, ...]]]


def stored_metrics(query: Query, scope: str) -> list[str]:
    """Names of the metrics stored in ``scope`` (``layer``, ``param``, or ``global`` for scalars), sorted.

    A loose index scan (one index seek per distinct name), so it stays cheap on long runs.
    """
    if scope == "global":
        sql = """WITH RECURSIVE names(name) AS (
                   SELECT MIN(name) FROM scalars
                   UNION ALL
                   SELECT (SELECT MIN(name) FROM scalars WHERE name > names.name) FROM names
                   WHERE names.name IS NOT NULL)
                 SELECT name FROM names WHERE name IS NOT NULL"""
        return [r[0] for r in query(sql, ())]
    sql = """WITH RECURSIVE names(name) AS (
               SELECT MIN(metric) FROM vectors WHERE scope = ?1
               UNION ALL
               SELECT (SELECT MIN(metric) FROM vectors WHERE scope = ?1 AND metric > names.name) FROM names
               WHERE names.name IS NOT NULL)
             SELECT name FROM names WHERE name IS NOT NULL"""
    return [r[0] for r in query(sql, (scope,))]


def stored_entries(query: Query, scope: str) -> list[str]:
    """Every layer (or parameter) name of every layout version, in model order of their first layout."""
    rows = query("SELECT name FROM entries WHERE scope = ? ORDER BY layout, idx", (scope,))
    return list(dict.fromkeys(r[0] for r in rows))


def check(what: str, wanted: Iterable[str], valid: Sequence[str], where: str) -> None:
    """Raise ValueError for the first name in ``wanted`` that is not in ``valid``, listing the valid ones.

    Args:
        what: what the names are (``metric``, ``layer``), for the message.
        wanted: the names asked for.
        valid: the names that exist, in the order to list them.
        where: how to see them all, e.g. ``run.layers``.
    """
    known = set(valid)
    for name in wanted:
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1)
        shown = ", ".join(repr(v) for v in valid[:LISTED])
        if len(valid) > LISTED:
            shown += f" ... ({len(valid)} in all: {where})"
        guess = f"did you mean {close[0]!r}? " if close else ""
        choices = f"valid {what}s are: {shown}" if valid else f"this run has no {what}s yet"
        raise ValueError(f"unknown {what} {name!r}; {guess}{choices}")


def scope_of(scope: str) -> str:
    """Check a vector scope name (``layer`` or ``param``)."""
    if scope not in (LAYER, PARAM):
        raise ValueError(f"unknown scope {scope!r}; valid scopes are: {LAYER!r}, {PARAM!r}")
    return scope


def owner_name(param: str, layers: dict[str, int]) -> str | None:
    """The layer whose module path prefixes a parameter's name (the root layer otherwise)."""
    parts = param.split(".")[:-1]
    while parts:
        name = ".".join(parts)
        if name in layers:
            return name
        parts.pop()
    return "(root)" if "(root)" in layers else None
