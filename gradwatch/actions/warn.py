"""Action ``warn``: record and print the finding; training is not touched."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class Warn(Action):
    """Nothing beyond recording and printing (which every finding gets)."""

    name = "warn"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Do nothing."""
        return {}
