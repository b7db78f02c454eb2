"""Action ``halt``: flush, write the verdict, raise ``gw.TrainingHalted`` before the update."""

from __future__ import annotations

from typing import Any

from gradwatch.actions import Action, Control
from gradwatch.findings import Finding
from gradwatch.rules import Rule


class Halt(Action):
    """Stop training from the offending step's ``optimizer.step()`` call."""

    name = "halt"

    def apply(self, rule: Rule | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Halt (raises)."""
        control.halt(finding)
        return {}
