"""Detector ``nonfinite``: NaN/Inf in the loss, the activations or the gradients, with its origin."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradwatch.detectors.base import Detector
from gradwatch.rootcause import words
from gradwatch.store.findings import Finding
from gradwatch.store.records import PARAM, StepRecord, present
from gradwatch.wording import layer as _layer
from gradwatch.wording import plural

HINT = (
    "guard the op that produced it (log/sqrt/division need a positive argument: add an epsilon or clamp; "
    "exp overflows beyond ~88 in float32: clamp its input, e.g. a log-variance), "
    "check the batch for NaN/Inf, lower the learning rate, or use bf16 instead of fp16"
)

#: the hint when the replay found the NaN/Inf in the data (the batch, or outlier samples)
HINT_DATA = (
    "look at the samples named and the data pipeline that made them; leave them out with a rule "
    "(gw.Rule(when='nonfinite', do='skip', skip_samples=True)) while you fix the data"
)

#: the hint when the samples' own (finite) values made an op's NaN/Inf (a 0 into a log or a divisor)
HINT_DATA_OP = (
    "look at the samples named and the data pipeline that made them; if such values are valid, guard the op "
    "(clamp its input, add an epsilon to the divisor); leave them out with a rule "
    "(gw.Rule(when='nonfinite', do='skip', skip_samples=True)) while you fix the data"
)

#: the hint when the weights already held NaN/Inf (an earlier update applied non-finite gradients)
HINT_WEIGHTS = (
    "keep a non-finite update out of the weights: gw.Rule(when='nonfinite', do='skip') (in the default rules) "
    "skips that step, do='rollback' restores the last good snapshot; then fix the cause of the first non-finite "
    "step (its finding)"
)


@dataclass
class NonFinite(Detector):
    """NaN/Inf in the loss, gradients or (on sampled steps) activations: always an error.

    Its ``layer`` is the origin found by replaying the step (see :mod:`gradwatch.step.origin`): the
    first module whose output went non-finite while its inputs were finite (forward), or the
    first module in backward order whose input gradient went non-finite while its output
    gradient was finite (backward); None when the model's input or the loss was the origin.
    """

    kind = "nonfinite"

    #: the latest step with a finding whose weights were finite, and its record (skipped or not, known later)
    _last: tuple[int, StepRecord] | None = field(default=None, init=False, repr=False)
    #: while the weights hold NaN/Inf: the step they were first found so, and that finding's layer and type
    _poisoned: tuple[int, str | None, str | None] | None = field(default=None, init=False, repr=False)

    def check(self, record: StepRecord) -> list[Finding]:
        """Report a step whose loss, gradients or activations are not all finite."""
        loss = record.scalars.get("loss")
        bad_loss = loss is not None and not math.isfinite(loss)
        # a step a GradScaler skipped is an overflow unless its forward pass went non-finite
        bad_forward = record.skipped and (record.origin or {}).get("phase") == "forward"
        if record.skipped and not (bad_loss or bad_forward):
            return []
        if record.gradients_finite():
            bad_grads = 0
        else:
            counts = record.vector("grad_nonfinite", PARAM)
            bad_grads = int(np.nansum(counts)) if counts is not None and (counts > 0).any() else 0
        act = record.vector("act_norm")
        bad_act = np.zeros(0, dtype=bool)
        if act is not None:
            bad_act = present(record, "layer", "act_norm") & ~np.isfinite(act)
        if not (bad_loss or bad_forward or bad_grads or bad_act.any()):
            # a finite step is not finite weights: batches that miss an embedding's NaN row are finite; the
            # weights are finite again (restored) when their norms, measured on sampled steps, say so
            weights = record.vector("param_norm", PARAM)
            if weights is not None and np.isfinite(weights[present(record, PARAM, "param_norm")]).all():
                self._poisoned = None
            return []
        origin = dict(record.origin or {})
        if origin.get("source") == "weights":
            origin = self._weights(record, origin)
        else:
            self._last, self._poisoned = (record.step, record), None
        if origin.get("how", "attributed") == "attributed" and origin.get("layer") is None:  # not replayed/reproduced
            origin = {**self._attribute(record, bad_act), **{k: v for k, v in origin.items() if v is not None}}
        layers = record.layout.layers
        grad_counts = record.vector("grad_nonfinite")
        bad_layers = []
        if grad_counts is not None:
            bad_layers = [layers[i] for i in np.flatnonzero(np.nan_to_num(grad_counts) > 0)]
        what = []
        if bad_loss:
            what.append(f"the loss is {loss}")
        if bad_grads:
            verb = "is" if bad_grads == 1 else "are"
            what.append(f"{plural(bad_grads, 'gradient element')} in {plural(len(bad_layers), 'layer')} {verb} NaN/Inf")
        if bad_act.any():  # a NaN norm has a NaN element; an Inf one an Inf, or finite ones beyond ~1e19
            nan = int((bad_act & np.isnan(act)).sum()) if act is not None else 0
            inf = int(bad_act.sum()) - nan
            if nan:
                what.append("1 layer's activations are NaN" if nan == 1 else f"{nan:,} layers' activations are NaN")
            if inf:
                what.append(f"{plural(inf, 'layer')}' activation norms overflow (Inf elements, or finite ones beyond "
                            "~1e19)" if inf > 1 else "1 layer's activation norm overflows (Inf elements, or finite "
                            "ones beyond ~1e19)")
        message = (words.nonfinite_message(origin, record.step, what)  # the op, line, cause and samples
                   or f"{_where(origin)} at step {record.step}: {', '.join(what)}.")
        # NaN activations alone, with a finite loss and finite gradients: the NaN reached no update (a forward
        # call whose output no backward pass used: a batch the loop dropped itself), so the step is sound; an
        # activation norm that overflows may be finite elements beyond ~1e19 that did reach the loss: an error
        unused = not (bad_loss or bad_forward or bad_grads) and record.gradients_finite() \
            and origin.get("source") != "weights" and act is not None and bool(np.isnan(act[bad_act]).all())
        if unused:
            message += (" The step's loss and every gradient are finite: the NaN reached neither, so its update is "
                        "sound (a forward call whose output no backward pass used, as when a loop drops a NaN batch "
                        "itself, or values masked away downstream).")
        data: dict[str, Any] = {
            "origin": origin.get("how", "attributed"),
            "type": origin.get("type"),
            "loss": loss,
            "nonfinite_grads": bad_grads,
            "layers": bad_layers[:20],
            "hint": _hint(origin.get("root_cause") or {}),
        }
        if origin.get("note"):
            data["note"] = origin["note"]
        data.update(words.data(origin))
        if self._poisoned is not None and origin.get("source") == "weights":
            data["lasting"] = f"weights NaN/Inf from step {self._poisoned[0]}"  # one finding for the stretch
        if unused:
            data["reached_update"] = False
        return [self.finding(record, "warning" if unused else "error", origin.get("layer"), message,
                             value=float(bad_grads), phase=origin.get("phase"), data=data)]

    def _weights(self, record: StepRecord, origin: dict[str, Any]) -> dict[str, Any]:
        """The origin of a step whose weights already held NaN/Inf, with the step whose update put them
        there: the latest non-finite step seen with finite weights, unless its update was skipped.

        The steps of one stretch of NaN/Inf weights keep the layer of its first (their findings fold
        into it, see :class:`gradwatch.store.findings.Cooldown`).
        """
        root = dict(origin.get("root_cause") or {})
        if "poisoned_at" in root:  # re-judged: as found during training
            since = root["poisoned_at"]
        else:
            since = self._last[0] if self._last is not None and not self._last[1].skipped else None
        if self._poisoned is None:
            self._poisoned = (record.step, origin.get("layer"), origin.get("type"))
        root["poisoned_at"] = since
        root["cause_detail"] = words.weights_detail(root, record.step)
        return {**origin, "layer": self._poisoned[1], "type": self._poisoned[2], "root_cause": root}

    @staticmethod
    def _attribute(record: StepRecord, bad_act: np.ndarray) -> dict[str, Any]:
        """The cheap attribution used when the step could not be replayed."""
        layout = record.layout
        if bad_act.any():
            i = int(np.flatnonzero(bad_act)[0])
            return {"phase": "forward", "layer": layout.layers[i], "type": layout.layer_types[i], "how": "attributed"}
        counts = record.vector("grad_nonfinite")
        if counts is not None and np.nansum(counts) > 0:
            i = int(np.flatnonzero(np.nan_to_num(counts) > 0)[-1])  # backward runs in reverse model order
            return {"phase": "backward", "layer": layout.layers[i], "type": layout.layer_types[i], "how": "attributed"}
        return {"phase": "forward", "layer": None, "how": "attributed", "source": "loss"}


def _hint(root: dict[str, Any]) -> str:
    """What to try, by the cause the replay found."""
    if root.get("cause") == "weights":
        return HINT_WEIGHTS
    if root.get("cause") != "data":
        return HINT
    return HINT_DATA_OP if root.get("op") else HINT_DATA


def _where(origin: dict[str, Any]) -> str:
    phase, layer = origin.get("phase"), origin.get("layer")
    if layer is not None:
        guess = "" if origin.get("how") == "replayed" else " (approximately: the step could not be replayed)"
        return f"NaN/Inf first appeared in the {phase} pass of {_layer(layer, origin.get('type'))}{guess}"
    source = origin.get("source")
    if source == "input":
        return "The model's input batch holds NaN/Inf"
    if phase == "backward":
        return "The gradient of the loss with respect to the model's output is already NaN/Inf (born in the loss)"
    return "The model's output is finite but the loss is NaN/Inf (born in the loss function)"
