"""Findings: what a detector reports about a step, as plain data, and the cooldown that folds repeats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: severities in increasing order
SEVERITIES = ("info", "warning", "error")

#: every finding kind, in the order docs/findings.md documents them
KINDS = (
    "nonfinite",
    "vanishing",
    "exploding",
    "loss_spike",
    "dead_units",
    "saturation",
    "update_ratio",
    "unused_parameter",
    "amp_overflow",
    "replica_divergence",
    "learning_rate",
    "zero_gradient",
    "unoptimized_parameter",
    "stale_gradient",
    "unmeasured",
    "attention_logits",
    "output_growth",
    "adam_epsilon",
)


def rank(severity: str) -> int:
    """Position of a severity in :data:`SEVERITIES` (info 0, warning 1, error 2)."""
    return SEVERITIES.index(severity)


@dataclass
class Finding:
    """One thing a detector found at one step.

    Attributes:
        kind: one of :data:`KINDS`.
        severity: ``info``, ``warning`` or ``error``.
        step: the optimizer step it was found at.
        layer: module path, or None for a global finding.
        message: one sentence for people.
        value: the number the finding is about (compared by a rule's ``above``/``below``).
        phase: ``forward`` or ``backward`` for non-finite findings.
        action: the action taken, filled in by the rule engine.
        data: further details (plain JSON-able values).
    """

    kind: str
    severity: str
    step: int
    layer: str | None
    message: str
    value: float | None = None
    phase: str | None = None
    action: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    id: int | None = None


class Cooldown:
    """Folds repeats: a (kind, layer, severity) is written at most once per ``steps`` steps.

    The repeats in between are counted on the finding that was written: its ``data["repeats"]``
    is how many occurrences it stands for (itself included) and ``data["last_step"]`` the last
    one. :meth:`take_updated` hands over the written findings whose count changed, so that the
    store can update them. A finding about a state that lasts carries ``data["lasting"]`` (the
    weights NaN/Inf from step 11 on): the repeats of the same state fold into its first finding
    however long it lasts, and neither folds into nor swallows a finding about something else.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._last: dict[tuple[str, str | None, str], Finding] = {}
        self._updated: dict[int, Finding] = {}

    def admit(self, finding: Finding) -> bool:
        """Whether ``finding`` is to be written (False: it was folded into an earlier one)."""
        key = (finding.kind, finding.layer, finding.severity)
        last = self._last.get(key)
        if last is not None and self._folds(finding, last):
            last.data["repeats"] = last.data.get("repeats", 1) + 1
            last.data["last_step"] = finding.step
            self._updated[id(last)] = last
            return False
        self._last[key] = finding
        return True

    def _folds(self, finding: Finding, last: Finding) -> bool:
        """Whether ``finding`` repeats ``last`` (of the same kind, layer and severity)."""
        lasting, before = finding.data.get("lasting"), last.data.get("lasting")
        if lasting is not None or before is not None:  # the same lasting state, however long; a new one is news
            return lasting == before
        return finding.step - last.step < self.steps

    def take_updated(self) -> list[Finding]:
        """Written findings whose repeat count changed since the last call."""
        updated, self._updated = list(self._updated.values()), {}
        return updated
