"""Detector base: what every detector of the judge stage is (its kind, its settings, its findings)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from gradwatch.findings import Finding
from gradwatch.records import StepRecord


@dataclasses.dataclass
class Detector:
    """Base of every detector.

    Attributes:
        enabled: run this detector.
    """

    kind: ClassVar[str] = ""
    #: True for detectors that judge a step's update, known one step later (update ratios)
    late: ClassVar[bool] = False

    enabled: bool = True

    def check(self, record: StepRecord) -> list[Finding]:
        """Findings about one step (called once per step, in step order)."""
        raise NotImplementedError

    def finding(self, record: StepRecord, severity: str, layer: str | None, message: str, **kw: Any) -> Finding:
        """A finding of this detector's kind for ``record``'s step."""
        return Finding(kind=self.kind, severity=severity, step=record.step, layer=layer, message=message, **kw)
