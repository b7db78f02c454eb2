"""Action ``skip``: this step changes nothing; parameters and optimizer state stay as they were."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.findings import Finding


class Skip(Action):
    """Skip the update; after ``max_consecutive`` skipped steps in a row, halt instead."""

    name = "skip"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Skip the step."""
        return control.skip(rule.param("max_consecutive") if rule is not None else 0)
