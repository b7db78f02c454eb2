"""Gate: which findings of a run fail a CI threshold, and how to say so in one line each.

Shared by ``gradwatch check``, the pytest plugin and anything else that turns a run into a
pass/fail answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gradwatch.encoding import whole
from gradwatch.errors import ConfigError
from gradwatch.store.findings import SEVERITIES, rank
from gradwatch.wording import place

#: the thresholds ``--fail-on`` accepts
FAIL_ON = ("warning", "error")


def check_fail_on(fail_on: str) -> str:
    """Validate a ``fail_on`` threshold (``warning`` or ``error``)."""
    if fail_on not in FAIL_ON:
        raise ConfigError(f"fail_on must be one of {', '.join(FAIL_ON)}, got {fail_on!r}")
    return fail_on


def failing(findings: pd.DataFrame, fail_on: str) -> pd.DataFrame:
    """The findings at or above the ``fail_on`` severity, in step order."""
    threshold = rank(check_fail_on(fail_on))
    keep = findings["severity"].map(lambda s: s in SEVERITIES and rank(s) >= threshold)
    return findings[keep.astype(bool)].reset_index(drop=True)


def text_or_none(value: Any) -> str | None:
    """A frame cell as text (NaN and None become None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return str(value)


@dataclass
class Item:
    """One finding as plain data: the row of ``check --format json`` (PRODUCT.md's shape)."""

    kind: str
    severity: str
    step: int
    layer: str | None
    phase: str | None
    message: str
    action: str | None
    repeats: int = 1
    hint: str | None = None
    origin: dict[str, Any] | None = field(default=None)
    #: where a NaN/Inf was born: op, source line, fact, cause (``gradwatch.rootcause``)
    root_cause: dict[str, Any] | None = None
    #: the samples the finding blames: indices in the batch, the user's ids, how, a summary of values
    samples: dict[str, Any] | None = None
    #: what replaying the step to find the root cause or the samples cost (ms)
    replay_ms: float | None = None
    #: where a NaN/Inf was born outside the model's layers (origin tracking's ``source``: input, loss)
    source: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> Item:
        """From a row of :meth:`gradwatch.Run.findings`."""
        data = row.data if isinstance(row.data, dict) else {}
        origin = data.get("origin") if isinstance(data.get("origin"), dict) else None
        root, samples, ms = data.get("root_cause"), data.get("samples"), data.get("replay_ms")
        return cls(kind=str(row.kind), severity=str(row.severity), step=int(row.step),
                   layer=text_or_none(row.layer), phase=text_or_none(row.phase), message=str(row.message),
                   action=text_or_none(row.action), repeats=whole(data.get("repeats"), 1),
                   hint=text_or_none(data.get("hint")), origin=origin,
                   root_cause=root if isinstance(root, dict) else None,
                   samples=samples if isinstance(samples, dict) else None,
                   replay_ms=float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None,
                   source=data.get("source") if isinstance(data.get("source"), str) else None)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of PRODUCT.md (plus ``repeats`` and ``hint``, and ``root_cause``, ``samples``
        and ``replay_ms`` when the step was replayed to explain it).
        """
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity, "step": self.step,
                               "layer": self.layer, "phase": self.phase, "message": self.message,
                               "action": self.action, "repeats": self.repeats}
        if self.hint:
            out["hint"] = self.hint
        for key in ("root_cause", "samples", "replay_ms"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def where(self) -> str:
        """``layer`` (and phase); the input batch or the loss for a NaN/Inf born there; else ``global``
        (:func:`gradwatch.wording.place`, as the report and the dashboard say it).
        """
        return place(self.layer, self.phase, self.source)

    def line(self) -> str:
        """One line for a log: step, kind, where, message, action and the suggested fix."""
        times = f" (x{self.repeats})" if self.repeats > 1 else ""
        action = f" [action: {self.action}]" if self.action else ""
        hint = f" Try: {self.hint}." if self.hint else ""
        return f"step {self.step}{times} {self.severity} {self.kind} at {self.where()}: {self.message}{action}{hint}"


def items(findings: pd.DataFrame) -> list[Item]:
    """Every row of a findings frame as an :class:`Item`."""
    return [Item.from_row(row) for row in findings.itertuples()]
