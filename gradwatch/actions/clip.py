"""Action ``clip``: scale this step's gradients down to a fixed or adaptive global norm."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class Clip(Action):
    """``max_norm`` fixed, or (when omitted) adaptive: the largest norm the run's own healthy
    history calls normal (the ``exploding`` detector's baseline).
    """

    name = "clip"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Clip the step's gradients."""
        return control.clip(rule.param("max_norm") if rule is not None else None)
