"""Report text: numbers, durations, times and lists of layers written for people."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gradwatch import encoding, wording


def fmt(value: Any) -> str:
    """A number for people: 3 significant digits, thousands separators for integers."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | np.integer):
        return f"{int(value):,}"
    if isinstance(value, float | np.floating):
        v = float(value)
        if not math.isfinite(v):
            return encoding.text(v)  # nan, inf, -inf: the string forms every output writes
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(value)


def duration(seconds: float) -> str:
    """A duration for people: ``850 ms``, ``11.5 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def stamp(t: Any) -> str | None:
    """A local date and time from seconds since the epoch (None for anything else)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if isinstance(t, int | float) else None


def without_gradients(layers: list[tuple[str, str, int, bool]], most: int = 8) -> str:
    """Which layers have no gradient norm, and why, from (name, type, parameters, has a gradient) in model order.

    The layer table lists every layer, the gradient flow only those with gradients: a layer without
    parameters (an activation, a pooling) has no gradient of its own. Empty when every layer has one.
    """
    def names(rows: list[tuple[str, str, int, bool]]) -> str:
        shown = [wording.layer(name, typ) for name, typ, _, _ in rows[:most]]
        if len(rows) > most:
            return ", ".join(shown) + f" and {len(rows) - most:,} more"
        return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]

    sentences = []
    bare = [row for row in layers if row[2] == 0]
    if bare:
        one = len(bare) == 1
        sentences.append(f"{names(bare)} {'has' if one else 'have'} no parameters, so no gradient of "
                         f"{'its' if one else 'their'} own: the gradient flow leaves {'it' if one else 'them'} out.")
    unfed = [row for row in layers if row[2] > 0 and not row[3]]
    if unfed:
        one = len(unfed) == 1
        sentences.append(f"{names(unfed)} {'has' if one else 'have'} parameters but no finite gradient norm "
                         "recorded (frozen, not used in the loss, or NaN/Inf throughout): the gradient flow leaves "
                         f"{'it' if one else 'them'} out.")
    return " ".join(sentences)
