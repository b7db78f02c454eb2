"""Action ``skip``: this step changes nothing; parameters and optimizer state stay as they were."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class Skip(Action):
    """Skip the update; after ``max_consecutive`` skipped steps in a row, halt instead; with
    ``skip_samples``, also leave the samples the finding blames out of later batches.
    """

    name = "skip"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Skip the step."""
        outcome = control.skip(rule.param("max_consecutive") if rule is not None else 0)
        if rule is not None and rule.param("skip_samples"):
            outcome.update(control.skip_samples(finding))
        return outcome
