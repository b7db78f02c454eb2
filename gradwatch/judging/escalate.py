"""Escalation: a clip that a rule needs again and again halts training (``max_clips`` within ``within`` steps)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradwatch.actions.base import Control
    from gradwatch.rules import Rule
    from gradwatch.store.findings import Finding


class Clips:
    """The steps on which each clipping rule clipped, to stop a run whose explosions keep coming back.

    A clip bounds one update; it does not remove the cause. When a rule with ``max_clips`` has clipped
    more than that many steps among the last ``within`` (0: the whole run), the explosion is systematic
    (a learning rate too high, data out of scale, an unstable layer) and training on burns the budget:
    the step halts instead, naming the first clipped step of the window as the one to restart from (or the
    step the learning rate was raised at, when an explosion of the window named the raise as its cause).
    """

    def __init__(self) -> None:
        #: per rule: the steps it clipped, each with the step to restart from before
        self._steps: dict[int, deque[tuple[int, int]]] = {}

    def clipped(self, rule: Rule | None, finding: Finding, control: Control, acted: list[Finding]) -> None:
        """``rule``'s clip was applied at ``finding``'s step; halt (raises ``TrainingHalted``) past its limit.

        Args:
            rule: the rule that clipped (None: a clip no rule limits).
            finding: the finding that called for the clip.
            control: the training's control, which halts.
            acted: the findings whose outcome is written when the step's actions end (this one joins them).
        """
        limit = rule.param("max_clips") if rule is not None else 0
        if rule is None or not limit:
            return
        within, step = rule.param("within"), finding.step
        steps = self._steps.setdefault(id(rule), deque())
        if steps and steps[-1][0] == step:
            return
        raised = finding.data.get("lr_raised_at")
        steps.append((step, min(step, raised) if isinstance(raised, int) else step))
        while within and step - steps[0][0] >= within:
            steps.popleft()
        if len(steps) <= limit:
            return
        first, restart = steps[0][0], min(r for _, r in steps)
        span = f"of the last {within} steps" if within else "of the run's steps"
        reason = (f"the {finding.kind} finding had to be clipped on {len(steps)} {span} (the first at step {first}, "
                  f"the latest: {finding.message.rstrip('.')}); clipping bounds each update, not the cause: lower "
                  f"the learning rate or fix the cause, and restart from before step {restart}.")
        finding.action = "halt"
        finding.data.setdefault("outcome", {}).update(
            {"halted": True, "clipped_steps": len(steps), "within": within, "restart_before": restart})
        if finding.id is not None and finding not in acted:
            acted.append(finding)
        control.halt(finding, reason)
