"""Detector ``unused_parameter``: a parameter that requires grad never receives one."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradwatch.detectors.base import Bound, Detector
from gradwatch.findings import Finding
from gradwatch.records import PARAM, StepRecord
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "the parameter is not on the path to the loss: a submodule forward never calls, a .detach() "
    "or torch.no_grad() that cuts the graph, or a branch that is never taken; freeze it "
    "(requires_grad_(False)) if that is intended"
)


@dataclass
class UnusedParameter(Detector):
    """Parameters that require grad and received no gradient in the first ``patience`` steps
    of a layout; one finding per layer that owns them.

    Attributes:
        patience: steps without a gradient before it is reported.
    """

    kind = "unused_parameter"
    bounds = {"patience": Bound(1)}
    patience: int = 3
    _seen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _version: int = field(default=-1, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Accumulate which parameters got a gradient; report the others at ``patience`` steps."""
        counts = record.vector("grad_nonfinite", PARAM)
        layout = record.layout
        if record.skipped or counts is None:
            return []
        if layout.version != self._version:
            self._seen, self._steps, self._version = np.zeros(len(layout.params), dtype=bool), 0, layout.version
        self._seen |= ~np.isnan(counts)
        self._steps += 1
        if self._steps != self.patience or not len(layout.trainable):
            return []
        unused = np.flatnonzero(~self._seen & np.asarray(layout.trainable, dtype=bool))
        by_layer: dict[str, list[str]] = {}
        for p in unused:
            by_layer.setdefault(layout.owner(int(p)), []).append(layout.params[p])
        out = []
        for layer, params in by_layer.items():
            numel = sum(layout.param_numel[layout.params.index(n)] for n in params)
            verb = "requires" if len(params) == 1 else "require"
            message = (f"{', '.join(_layer(p) for p in params)} ({plural(numel, 'element')}) {verb} grad but received "
                       f"no gradient in {plural(self.patience, 'step')}.")
            out.append(self.finding(record, "warning", layer, message, value=float(len(params)),
                                    data={"parameters": params, "hint": HINT}))
        return out
