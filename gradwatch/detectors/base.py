"""Detector base: what every detector of the judge stage is (its kind, its settings, its findings)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from gradwatch.detectors.causes import Causes
from gradwatch.store.findings import Finding
from gradwatch.store.records import StepRecord


@dataclasses.dataclass(frozen=True)
class Bound:
    """The valid range of a numeric detector setting.

    ``low`` and ``high`` are numbers, the name of another setting of the same detector (the range
    then follows that setting's value), or None (no limit); ``open_low`` / ``open_high`` exclude
    the limit itself.
    """

    low: float | str | None = None
    high: float | str | None = None
    open_low: bool = False
    open_high: bool = False

    @property
    def related(self) -> list[str]:
        """The other settings this range depends on."""
        return [x for x in (self.low, self.high) if isinstance(x, str)]

    def problem(self, value: float, settings: Mapping[str, Any]) -> str | None:
        """None when ``value`` is in range, else what the range is (``from 0 to 1 (1 excluded)``)."""
        low, high = (settings.get(x, math.nan) if isinstance(x, str) else x for x in (self.low, self.high))
        ok = ((low is None or (value > low if self.open_low else value >= low))
              and (high is None or (value < high if self.open_high else value <= high)))
        return None if ok else self.describe(settings)

    def describe(self, settings: Mapping[str, Any]) -> str:
        """The range in words; a limit that is another setting is shown with its value."""
        def shown(limit: float | str) -> str:
            return f"{limit!r} ({settings.get(limit)!r})" if isinstance(limit, str) else f"{limit:g}"

        def short(limit: float | str) -> str:
            return repr(limit) if isinstance(limit, str) else f"{limit:g}"

        if self.low is not None and self.high is not None:
            gone = [short(x) for x, out in ((self.low, self.open_low), (self.high, self.open_high)) if out]
            excluded = f" ({' and '.join(gone)} excluded)" if gone else ""
            return f"from {shown(self.low)} to {shown(self.high)}{excluded}"
        if self.low is not None:
            return f"{'greater than' if self.open_low else 'at least'} {shown(self.low)}"
        assert self.high is not None
        return f"{'less than' if self.open_high else 'at most'} {shown(self.high)}"


@dataclasses.dataclass
class Detector:
    """Base of every detector.

    Attributes:
        enabled: run this detector.
    """

    kind: ClassVar[str] = ""
    #: True for detectors that judge a step's update, known one step later (update ratios)
    late: ClassVar[bool] = False
    #: the valid range of each numeric setting that has one (checked before the detector is built)
    bounds: ClassVar[Mapping[str, Bound]] = {}

    enabled: bool = True
    #: the root causes named so far by the detectors built together (see :mod:`gradwatch.detectors.causes`)
    causes: Causes = dataclasses.field(default_factory=Causes, init=False, repr=False, compare=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Findings about one step (called once per step, in step order)."""
        raise NotImplementedError

    def finding(self, record: StepRecord, severity: str, layer: str | None, message: str, **kw: Any) -> Finding:
        """A finding of this detector's kind for ``record``'s step."""
        return Finding(kind=self.kind, severity=severity, step=record.step, layer=layer, message=message, **kw)


def median(values: np.ndarray) -> float:
    """The median of a small non-empty vector (np.median's overhead is 30x a sort of 50 values)."""
    ordered = np.sort(values)
    n = len(ordered)
    return float(0.5 * (ordered[(n - 1) // 2] + ordered[n // 2]))


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value that half of the total weight is at or above (each layer counted by its parameters)."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][min(int(np.searchsorted(cum, 0.5 * cum[-1])), len(cum) - 1)])
