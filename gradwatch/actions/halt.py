"""Action ``halt``: flush, write the verdict, raise ``gw.TrainingHalted`` before the update."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class Halt(Action):
    """Stop training from the offending step's ``optimizer.step()`` call."""

    name = "halt"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Halt (raises)."""
        control.halt(finding)
        return {}
