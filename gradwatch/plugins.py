"""Plugins: third-party detectors, actions and sinks, found through entry points by name.

A package adds one by declaring an entry point in one of three groups::

    [project.entry-points."gradwatch.detectors"]
    grad_noise = "mypkg.gradwatch_plugins:GradNoise"      # a Detector subclass, kind "grad_noise"

    [project.entry-points."gradwatch.actions"]
    page_oncall = "mypkg.gradwatch_plugins:PageOncall"   # an Action subclass, name "page_oncall"

    [project.entry-points."gradwatch.sinks"]
    jsonl = "mypkg.gradwatch_plugins:JsonLines"         # a class: Sink(run_dir, **settings)

Plugins are looked up only when a configuration names one (``detectors={"grad_noise": {}}``,
``Rule(when=..., do="page_oncall")``, ``sinks=["jsonl"]``) and loaded then, one by one: a plugin
that is installed but broken cannot affect a run that does not ask for it, and one that is
asked for and fails to load is a :class:`~gradwatch.errors.ConfigError` naming it, before
training starts. A plugin that raises while training is disabled for the rest of the run with a
:class:`~gradwatch.errors.PluginWarning`; the built-in detectors, actions and sinks go on.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from gradwatch.errors import ConfigError, PluginWarning

__all__ = ["GROUPS", "PluginWarning", "exists", "load", "names"]

GROUPS = {"detector": "gradwatch.detectors", "action": "gradwatch.actions", "sink": "gradwatch.sinks"}


def names(role: str) -> list[str]:
    """The names of the installed plugins of one role (``detector``, ``action`` or ``sink``)."""
    return sorted({ep.name for ep in _entry_points(role)})


def exists(role: str, name: str) -> bool:
    """Whether a plugin of this role and name is installed (without loading it)."""
    return any(ep.name == name for ep in _entry_points(role))


def load(role: str, name: str, base: type | None = None) -> Any:
    """Load the plugin ``name`` of a role; with ``base``, it must be a subclass of it.

    Raises:
        ConfigError: no such plugin, more than one, or it fails to import or is not a ``base``.
    """
    group = GROUPS[role]
    found = [ep for ep in _entry_points(role) if ep.name == name]
    if not found:
        installed = ", ".join(names(role)) or "none"
        raise ConfigError(f"no {role} named {name!r} is installed (entry point group {group!r}); "
                          f"installed {role} plugins: {installed}")
    if len({ep.value for ep in found}) > 1:
        where = "; ".join(f"{ep.value} ({_dist(ep)})" for ep in found)
        raise ConfigError(f"{role} plugin {name!r} is declared by more than one package: {where}")
    ep = found[0]
    try:
        obj = ep.load()
    except Exception as exc:  # an import error, or anything the plugin's module raises on import
        raise ConfigError(f"{role} plugin {name!r} ({ep.value}, from {_dist(ep)}) failed to load: "
                          f"{type(exc).__name__}: {exc}") from exc
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(f"{role} plugin {name!r} ({ep.value}, from {_dist(ep)}) must be a subclass of "
                          f"{base.__module__}.{base.__qualname__}, got {obj!r}")
    return obj


def _entry_points(role: str) -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=GROUPS[role]))


def _dist(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
