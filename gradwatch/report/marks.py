"""Report marks: how the report and the dashboard agree on what a chart marks (flagged layers, log scales)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from gradwatch.encoding import whole
from gradwatch.store.findings import rank

#: a positive series whose largest value is more than this many times its smallest is drawn on a log scale
LOG_SPAN = 1e3


def loss_log(values: Iterable[float] | np.ndarray) -> bool:
    """Whether the loss curve is drawn on a log scale: positive throughout and spanning over ``LOG_SPAN``x.

    A loss that can be zero or negative (a log-likelihood, a regularised objective) stays linear.
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return bool(len(v) and v.min() > 0 and v.max() / v.min() > LOG_SPAN)


def flow_marks(findings: pd.DataFrame, step: int, layers: Iterable[str]) -> tuple[dict[str, str], dict[str, int]]:
    """Which layers a gradient-flow chart shown at ``step`` marks, and how.

    A finding holds at ``step`` from its own step through its last folded repeat
    (``data["last_step"]``); a finding that ended before ``step`` is history, not the state of the
    step shown. Info findings mark nothing.

    Returns:
        ``(now, earlier)``: the layers with a warning or error holding at ``step`` (the worst
        severity), and the other layers with one before ``step`` (the step of the latest).
    """
    wanted = set(layers)
    now: dict[str, str] = {}
    earlier: dict[str, int] = {}
    for layer, at, severity, data in zip(findings["layer"], findings["step"], findings["severity"], findings["data"]):
        if not isinstance(layer, str) or layer not in wanted or severity not in ("warning", "error"):
            continue
        at = int(at)
        last = _last_step(data, at)
        if at <= step <= last:
            if layer not in now or rank(severity) > rank(now[layer]):
                now[layer] = str(severity)
        elif last < step:
            earlier[layer] = max(earlier.get(layer, at), at)
    return now, {layer: at for layer, at in earlier.items() if layer not in now}


def _last_step(data: Any, step: int) -> int:
    last = data.get("last_step") if isinstance(data, dict) else None
    return max(step, whole(last, step))
