"""Actions: what a rule does about a step's findings — one file per action, listed in REGISTRY.

An action only acts, through the :class:`~gradwatch.step.control.Control` of the training style
(a plain loop here; Lightning and the HF Trainer adapt it in ``gradwatch.integrations``). Every
action runs inside the optimizer's step pre-hook, before the update is applied, and after its
findings are on disk. :meth:`Action.apply` returns what it did, as plain data for the findings.

Third-party actions come from the ``gradwatch.actions`` entry-point group (see
:mod:`gradwatch.plugins`): an :class:`Action` subclass whose ``name`` is its entry point's name,
with its rule parameters in ``params``. A rule names it with ``do``; it runs beside the step's
built-in action (before it), once per step, with the first finding that called for it.
"""

from __future__ import annotations

from gradwatch.actions import clip, halt, rollback, scale_lr, skip, warn
from gradwatch.actions.base import Action, Control, Params

__all__ = ["REGISTRY", "Action", "Control", "Params", "build"]


def _registry() -> dict[str, Action]:
    actions: list[Action] = [
        warn.Warn(), clip.Clip(), skip.Skip(), rollback.Rollback(), scale_lr.ScaleLr(), halt.Halt(),
    ]
    return {a.name: a for a in actions}


REGISTRY: dict[str, Action] = _registry()


def build(name: str) -> Action:
    """The action a rule names: a built-in one, or a new instance of an installed plugin.

    Raises:
        ConfigError: no such action, or a plugin that fails to load or to build.
    """
    if name in REGISTRY:
        return REGISTRY[name]
    from gradwatch import plugins
    from gradwatch.errors import ConfigError

    cls = plugins.load("action", name, Action)
    try:
        return cls()
    except Exception as exc:  # the plugin's own __init__
        raise ConfigError(f"action plugin {name!r} failed to build: {type(exc).__name__}: {exc}") from exc
