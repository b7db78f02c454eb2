"""Action ``scale_lr``: multiply the learning rate by a factor (from this step on)."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class ScaleLr(Action):
    """Multiply every parameter group's LR (and the LR schedulers' base LRs) by ``factor``."""

    name = "scale_lr"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Scale the learning rate."""
        assert rule is not None
        return control.scale_lr(rule.param("factor"))
