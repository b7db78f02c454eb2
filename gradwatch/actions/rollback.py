"""Action ``rollback``: restore the last known-good snapshot instead of applying this step."""

from __future__ import annotations

from typing import Any

from gradwatch.actions.base import Action, Control, Params
from gradwatch.store.findings import Finding


class Rollback(Action):
    """Restore model, optimizers, LR schedulers, GradScaler and RNG; optionally skip the next
    ``skip_batches`` batches (or, with ``skip_samples``, only the samples the finding blames) and
    scale the LR by ``lr_scale``; after ``max_rollbacks`` halt.
    """

    name = "rollback"

    def apply(self, rule: Params | None, finding: Finding, control: Control) -> dict[str, Any]:
        """Roll back."""
        assert rule is not None
        outcome = control.rollback(rule.param("skip_batches"), rule.param("lr_scale"), rule.param("max_rollbacks"))
        if rule.param("skip_samples"):
            outcome.update(control.skip_samples(finding))
        return outcome
