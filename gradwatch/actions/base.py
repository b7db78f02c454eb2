"""Action base: what every action of the act stage is, and the Control and rule Params it acts through."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from gradwatch.store.findings import Finding


class Params(Protocol):
    """The parameters a rule gives its action (a :class:`gradwatch.Rule` is one)."""

    def param(self, name: str) -> Any:
        """The value of parameter ``name``: the rule's own, or the action's default."""


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

    def skip_samples(self, finding: Finding) -> dict[str, Any]:
        """Leave the samples ``finding`` blames (``data["samples"]``) out of training from now on."""

    def halt(self, finding: Finding | None, reason: str | None = None) -> None:
        """Flush, write the verdict and raise ``gw.TrainingHalted`` (``reason``: why, else the finding's message)."""


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

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Act on the step; returns details recorded with the finding."""
        raise NotImplementedError
