"""Report text: numbers, durations and times written for people."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gradwatch import encoding


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
