"""Example gradwatch plugins, one of each kind.

- ``loss_plateau`` (detector): the loss has not improved on its best value by ``min_improvement``
  (relative) for ``patience`` steps;
- ``append_json`` (action): append the finding that called for it, as one JSON line, to the
  file a rule's ``path`` names (a stand-in for paging someone or posting to a chat);
- ``jsonl`` (sink): every step's global scalars as JSON lines in ``<run>/<filename>``.

Use them by name once this package is installed::

    from gradwatch.rules import DEFAULT_RULES

    gw.watch(model, detectors={"loss_plateau": {"patience": 200}},
             rules=[gw.Rule(when="loss_plateau", do="append_json", path="alerts.jsonl"), *DEFAULT_RULES],
             sinks=["jsonl"])
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradwatch.actions import Action, Control
from gradwatch.detectors import Detector
from gradwatch.rules import REQUIRED, Rule
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord


@dataclass
class LossPlateau(Detector):
    """The loss has not improved for ``patience`` steps (one warning per plateau).

    Attributes:
        patience: steps without improvement before it is reported.
        min_improvement: the relative drop below the best loss that counts as an improvement.
    """

    kind = "loss_plateau"
    patience: int = 500
    min_improvement: float = 0.01
    _best: float = field(default=math.inf, init=False, repr=False)
    _since: int = field(default=0, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        loss = record.scalars.get("loss")
        if loss is None or not math.isfinite(loss) or record.skipped:
            return []  # never let a non-finite or skipped step move the baseline
        if loss < self._best * (1 - self.min_improvement):
            self._best, self._since = loss, 0
            return []
        self._since += 1
        if self._since != self.patience:
            return []
        message = f"the loss ({loss:.4g}) has not improved on its best ({self._best:.4g}) for {self.patience} steps"
        return [self.finding(record, "warning", None, message, value=loss,
                             data={"hint": "lower the learning rate, or stop: training has converged or stalled"})]


class AppendJson(Action):
    """Append the finding to a JSON-lines file (``path``, a rule parameter)."""

    name = "append_json"
    params = {"path": (str, REQUIRED)}

    def apply(self, rule: Rule | None, finding: Finding, control: Control) -> dict[str, Any]:
        path = Path(rule.param("path") if rule is not None else "gradwatch-findings.jsonl")
        line = {"step": finding.step, "kind": finding.kind, "severity": finding.severity,
                "layer": finding.layer, "message": finding.message}
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return {"appended_to": str(path)}


class JsonLines:
    """Every step's number, skipped flag and global scalars as one JSON line."""

    def __init__(self, run_dir: Path, filename: str = "steps.jsonl") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / filename).open("a", encoding="utf-8")

    def write(self, records: Sequence[StepRecord]) -> None:
        for rec in records:
            if rec.flight:  # a flight-recorder copy of a step written before
                continue
            scalars = {k: (v if math.isfinite(v) else None) for k, v in rec.scalars.items()}
            self._file.write(json.dumps({"step": rec.step, "skipped": rec.skipped, **scalars}) + "\n")
        self._file.flush()

    def close(self, status: str) -> None:
        self._file.close()
