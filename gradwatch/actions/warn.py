"""Action ``warn``: record and print the finding; training is not touched."""

from __future__ import annotations

from typing import Any

from gradwatch.actions import Action, Control
from gradwatch.findings import Finding
from gradwatch.rules import Rule


class Warn(Action):
    """Nothing beyond recording and printing (which every finding gets)."""

    name = "warn"

    def apply(self, rule: Rule | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Do nothing."""
        return {}
