"""Actions: what a rule does about a step's findings — one file per action, listed in REGISTRY.

An action only acts, through the :class:`~gradwatch.control.Control` of the training style
(a plain loop here; Lightning and the HF Trainer adapt it in ``gradwatch.integrations``). Every
action runs inside the optimizer's step pre-hook, before the update is applied, and after its
findings are on disk. :meth:`Action.apply` returns what it did, as plain data for the findings.

Third-party actions come from the ``gradwatch.actions`` entry-point group (see
:mod:`gradwatch.plugins`): an :class:`Action` subclass whose ``name`` is its entry point's name,
with its rule parameters in ``params``. A rule names it with ``do``; it runs beside the step's
built-in action (before it), once per step, with the first finding that called for it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from gradwatch.findings import Finding
from gradwatch.rules import Rule


class Control(Protocol):
    """What actions may do to training; implemented per training style."""

    def clip(self, max_norm: float | None) -> dict[str, Any]:
        """Scale this step's gradients so that their global norm is at most ``max_norm``
        (None: the adaptive bound from the run's own history).
        """

    def skip(self, max_consecutive: int) -> dict[str, Any]:
        """Make this step change nothing; halt after ``max_consecutive`` skips in a row."""

    def rollback(self, skip_batches: int, lr_scale: float, max_rollbacks: int) -> dict[str, Any]:
        """Restore the last known-good snapshot instead of applying this step."""

    def scale_lr(self, factor: float) -> dict[str, Any]:
        """Multiply the learning rate of every parameter group by ``factor``."""

    def halt(self, finding: Finding) -> None:
        """Flush, write the verdict and raise ``gw.TrainingHalted``."""


class Action:
    """Base of every action: ``apply`` one rule's call to the step's training.

    Attributes:
        name: what rules call it (``do=name``).
        params: the rule parameters it takes, ``{name: (type, default)}`` with type ``int``,
            ``float``, ``str`` or ``bool`` and default :data:`gradwatch.rules.REQUIRED` for one
            a rule must give; read them with ``rule.param(name)``.
    """

    name: ClassVar[str] = ""
    params: ClassVar[dict[str, tuple[type, Any]]] = {}

    def apply(self, rule: Rule | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Act on the step; returns details recorded with the finding."""
        raise NotImplementedError


def _registry() -> dict[str, Action]:
    from gradwatch.actions import clip, halt, rollback, scale_lr, skip, warn

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
