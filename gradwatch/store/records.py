"""Records: the plain-data step record that flows from the statistics to the detectors and sinks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: per-layer (and per-parameter) gradient and parameter metrics
GRAD_METRICS = ("grad_norm", "grad_max", "grad_nonfinite", "param_norm", "update_ratio")
#: per-leaf-module activation metrics
ACT_METRICS = ("act_norm", "act_zero_frac", "act_sat_frac")
#: metrics measured on every step; the others only on sampled steps
EVERY_STEP_METRICS = ("grad_norm", "grad_nonfinite")
#: observed scalar: the global gradient norm before a framework's (or the user's) own clipping,
#: when gradients are measured after it (the HF Trainer's ``max_grad_norm``); the ``exploding``
#: detector judges it instead of the clipped ``grad_norm``
PRECLIP = "grad_norm_preclip"
#: the GradScaler's loss scale, recorded on the steps it skipped
AMP_SCALE = "amp_scale"
#: the factor the loop scaled every gradient by between backward and the step (``clip_grad_norm_``),
#: recorded when it is not 1 (see :mod:`gradwatch.step.preclip`)
CLIP_COEF = "clip_coef"
#: how many times ``optimizer.step(closure)`` evaluated its closure (more than once: a line search, as in
#: L-BFGS, sized the step); recorded on closure steps, complete once the step has ended
CLOSURE_EVALUATIONS = "closure_evaluations"
#: for how many steps in a row the gradients an optimizer step applies still held the previous step's
#: (not cleared between the two: no ``zero_grad()``); recorded when it is not 0
GRAD_STALE = "grad_stale_steps"
#: per-parameter vector, on sampled steps: the ``eps`` of the param group that holds the parameter in an
#: optimizer whose update divides by sqrt(v) + eps (the Adam family: see :meth:`Optimizers.adam_eps
#: <gradwatch.step.optimizers.Optimizers.adam_eps>`); NaN for a parameter no such optimizer holds, absent without any
ADAM_EPS = "adam_eps"
#: scalars per attention module, on sampled steps (:mod:`gradwatch.step.attending`), each named
#: :func:`layer_scalar` (``attn_logit_max/blocks.0.attn``): the largest attention logit of any head, the head holding
#: it, the lowest mean attention entropy (nats) of any head, and that head
ATTN_LOGIT_MAX, ATTN_LOGIT_HEAD = "attn_logit_max", "attn_logit_head"
ATTN_ENTROPY, ATTN_ENTROPY_HEAD = "attn_entropy", "attn_entropy_head"

#: the name of the root module among a run's layers
ROOT = "(root)"
LAYER = "layer"
PARAM = "param"


def layer_scalar(metric: str, layer: str) -> str:
    """The name of a scalar recorded per layer, for a module that is no layer of the run (an attention module)."""
    return f"{metric}/{layer}"


@dataclass(frozen=True)
class Layout:
    """The fixed order of layers and parameters that every vector in a record follows.

    Attributes:
        version: increases each time the watched set of layers or parameters changes.
        layers: module paths in model order (modules that own parameters, and leaf modules).
        layer_types: class name of each layer's module.
        layer_numel: number of parameter elements each layer owns directly.
        params: qualified parameter names, each parameter once (tied parameters by first name).
        param_numel: number of elements of each parameter.
        owners: pairs (layer index, parameter index): which layers own which parameters.
        leaves: indices of leaf layers (those with activation statistics).
        saturating: indices of leaf layers whose outputs are bounded (sigmoid/tanh family).
        trainable: for each parameter, whether it required a gradient when discovered.
        eps: for each parameter, its dtype's machine epsilon when discovered (float32's 1.2e-7, bfloat16's
            7.8e-3; empty when not known: read from a run stored before it was kept).
        renewed: the layers whose parameters are other objects than in the version before, or shared anew
            (a head replaced, weights tied, ``load_state_dict(assign=True)``): their histories, and the
            model's, restart (empty for a first version, and for one that only froze, unfroze or cast).
    """

    version: int
    layers: tuple[str, ...]
    layer_types: tuple[str, ...]
    layer_numel: tuple[int, ...]
    params: tuple[str, ...]
    param_numel: tuple[int, ...]
    owners: tuple[tuple[int, int], ...]
    leaves: tuple[int, ...]
    saturating: tuple[int, ...] = ()
    trainable: tuple[bool, ...] = ()
    eps: tuple[float, ...] = ()
    renewed: tuple[int, ...] = ()

    def names(self, scope: str) -> tuple[str, ...]:
        """The entry names of a scope (``"layer"`` or ``"param"``)."""
        return self.layers if scope == LAYER else self.params

    def owner(self, param: int) -> str:
        """The first layer (in model order) that owns a parameter."""
        return next(self.layers[layer] for layer, p in self.owners if p == param)

    def same_layers(self, other: Layout | None) -> bool:
        """Whether ``other`` has the same layers, of the same sizes: a newer version of it only froze,
        unfroze or replaced parameters, and per-layer histories carry over.
        """
        return other is not None and (self.layers, self.layer_numel) == (other.layers, other.layer_numel)

    def param_layers(self) -> list[str | None]:
        """The layer each parameter belongs to, in parameter order (a tied one: its last owner)."""
        out: list[str | None] = [None] * len(self.params)
        for layer, param in self.owners:
            out[param] = self.layers[layer]
        return out


@dataclass(slots=True)  # no __dict__: records are kept (writer queue, flight recorder) by the hundred
class StepRecord:
    """Everything measured at one optimizer step, as host-side numbers.

    Attributes:
        step: 0-based index of the optimizer step.
        time: wall-clock time (seconds since the epoch) when the step's gradients were final.
        layout: the layout the vectors follow.
        scalars: global numbers: ``grad_norm``, ``loss``, ``lr`` and anything observed.
        vectors: ``(scope, metric) -> float32 vector`` over the layout's layers or params;
            NaN where a value does not exist (no gradient, leaf not called).
        skipped: the step changed nothing (an overflow step skipped by a GradScaler, or a
            skip action).
        logged: per-layer vectors are written to the store for this step.
        sampled: the costlier statistics were measured on this step.
        detail: per-parameter vectors are written too (sampled steps, and steps with
            non-finite gradients); otherwise only per-layer vectors are.
        origin: where a non-finite value was born (``phase``, ``layer``, ``type``, ``how``),
            found by replaying the step; None when everything was finite.
        flight: re-sent by the flight recorder when a finding fired (its global scalars were
            already written; its per-layer vectors were not).
        histograms: on sampled steps with ``wandb_histograms``, ``{"gradients/<param>": (counts,
            bin edges), "parameters/<param>": ...}`` (see :mod:`gradwatch.step.histograms`); else None.
    """

    step: int
    time: float
    layout: Layout
    scalars: dict[str, float] = field(default_factory=dict)
    vectors: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    skipped: bool = False
    logged: bool = False
    sampled: bool = False
    detail: bool = False
    origin: dict[str, Any] | None = None
    flight: bool = False
    histograms: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    def vector(self, metric: str, scope: str = LAYER) -> np.ndarray | None:
        """One metric's vector, or None when it was not measured on this step."""
        return self.vectors.get((scope, metric))

    def gradients_finite(self) -> bool:
        """Whether the global gradient norm is known and finite: then so is every gradient element
        (a NaN or Inf makes the sum of squares NaN or Inf), and no count needs scanning.
        """
        total = self.scalars.get("grad_norm")
        return total is not None and math.isfinite(total)


def present(record: StepRecord, scope: str, metric: str) -> np.ndarray:
    """Which entries of a vector hold a measured value (a real NaN gradient counts as measured).

    A gradient metric exists where the parameter received a gradient (``grad_nonfinite`` is a
    count, not NaN); an activation metric where the leaf ran (``act_zero_frac`` is not NaN); a
    parameter norm where it was measured or where a gradient exists (NaN weights included).
    """
    values = record.vectors[(scope, metric)]
    if metric == "act_sat_frac":
        return ~np.isnan(values)
    if metric in ACT_METRICS:
        ref = record.vectors.get((scope, "act_zero_frac"), values)
        return ~np.isnan(ref)
    has_grad = ~np.isnan(record.vectors.get((scope, "grad_nonfinite"), values))
    if metric == "param_norm":
        return has_grad | ~np.isnan(values)
    return has_grad
